"""``benchmark/codec/exact_bits.py``'s streamed request: the page runs a layered prefill writes per layer."""

from __future__ import annotations

import pytest
from benchmark.codec.exact_bits import streamed_runs


@pytest.mark.parametrize(("tokens", "chunk", "want"), [
    (5619, 4096, [[(0, 16)], [(16, 21)], [(21, 22)]]),  # the 5.6K sweep's prompt: chunks 4,096 + 1,523
    (4096, 4096, [[(0, 15)], [(15, 16)]]),  # the page of the last token goes with the last part
    (8192, 4096, [[(0, 16)], [(16, 31)], [(31, 32)]]),
    (256, 4096, [[(0, 1)]]),  # one page: only the last part
    (300, 4096, [[(0, 1)], [(1, 2)]]),
])
def test_runs_follow_the_chunks_and_the_last_page_goes_last(tokens: int, chunk: int,
                                                            want: list[list[tuple[int, int]]]) -> None:
    got = streamed_runs(tokens, 256, chunk)
    assert got == want
    flat = [run for part in got for run in part]
    assert flat[0][0] == 0 and flat[-1][1] == -(-tokens // 256)
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:], strict=False))
