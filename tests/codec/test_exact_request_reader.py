"""``ExactRequestReader``: a request's BF16 KV restored while its parts land, byte-equal to the prefill KV.

The prefill side is the real one (``PartEncoder`` parts per layer group, ``ExactRequestWriter`` pieces);
the receiver's staging starts as random bytes, and the parts' spans land in random orders (a part's
exact bytes may come before its own anchor or residual): whatever the reader restores ahead must come
only from bytes in place, so any byte read too early shows as a mismatch. Unit tier: no transport.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from test_exact_request import HEADS, LAYERS, assert_same_kv, request_kv

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.exact_request import ExactRequestWriter, PieceRunner, exact_request_capacity, run_in_order
from sglang_lynx.codec.exact_request_reader import ExactRequestReader
from sglang_lynx.codec.lynx_exact import ExactStreamError
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.codec.wire_residual import residual_from_wire, residual_tail_bytes
from sglang_lynx.transfer.receiver import _merged

DIM = 64
Landing = tuple[str, list[tuple[int, int]]]  # (stream, spans)


def _reversed_on(pool: ThreadPoolExecutor) -> PieceRunner:
    """A piece runner that starts the jobs last first on a pool's threads (results still in order)."""
    def run(fn: Any, jobs: Any) -> list[Any]:
        futures = [pool.submit(fn, job) for job in reversed(jobs)]
        return [future.result() for future in reversed(futures)]
    return run


def _streamed(ks: list[torch.Tensor], vs: list[torch.Tensor], codec: object, page_tokens: int, gen: torch.Generator,
              complete: bool = False, run_pieces: PieceRunner = run_in_order,
              ) -> tuple[list[list[Landing]], dict[str, torch.Tensor]]:
    """The request encoded part by part (random page ends and layer groups) as the prefill streams it: each
    part's landings and the three whole streams. ``complete``: each group's last part takes its layers to
    the end (partial last page and trailers, as a forward that computed the last token), so the request's
    last part has nothing left but the close."""
    tokens = int(ks[0].shape[0])
    parts = PartEncoder(codec, LAYERS, tokens, HEADS, DIM)  # type: ignore[arg-type]
    anchor = torch.zeros(parts.anchor_bytes, dtype=torch.uint8)
    computed, body = parts.new_scratch(), torch.zeros(parts.body_bytes, dtype=torch.uint8)
    exact = torch.zeros(exact_request_capacity(LAYERS, tokens, HEADS, DIM, page_tokens), dtype=torch.uint8)
    writer = ExactRequestWriter(codec, LAYERS, tokens, HEADS, DIM, exact, run_pieces=run_pieces)  # type: ignore[arg-type]
    landings: list[list[Landing]] = []
    group = 1 + int(torch.randint(LAYERS, (1,), generator=gen))
    full = tokens // page_tokens
    ends = sorted({1 + int(i) for i in torch.randint(max(full, 1), (3,), generator=gen)} & set(range(1, full + 1)))
    plan = [(end, range(at, min(LAYERS, at + group)), False) for end in ends for at in range(0, LAYERS, group)]
    if complete and (ends[-1] if ends else 0) < parts.pages:
        plan += [(parts.pages, range(at, min(LAYERS, at + group)), False) for at in range(0, LAYERS, group)]
    for end_page, layers, last in [*plan, (parts.pages, None, True)]:
        runs = parts.runs(end_page, last, layers)
        a_spans, b_spans = parts.encode_part(ks, vs, end_page, last, anchor, computed, body, layers)
        at, n = writer.write(ks, vs, anchor, computed, runs, last)
        landings.append([("anchor", a_spans), ("residual", b_spans), ("exact", [(at, n)])])
    return landings, {"anchor": anchor, "residual": body, "exact": exact[: writer.length]}


@pytest.mark.parametrize("tokens,page_tokens", [(300, 64), (200, 16), (47, 16)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("complete", [False, True], ids=["last-part-completes", "groups-complete"])
def test_pieces_restored_while_parts_land_in_any_order_equal_the_prefill_kv(tokens: int, page_tokens: int,
                                                                             seed: int, complete: bool) -> None:
    codec = get_codec("lynx-exact", page_tokens=page_tokens, chunk_tokens=min(32, page_tokens))
    gen = torch.Generator().manual_seed(seed)
    ks, vs = request_kv(tokens)
    landings, whole = _streamed(ks, vs, codec, page_tokens, gen, complete)
    staging = {name: torch.randint(0, 256, (int(t.numel()) + 64,), dtype=torch.uint8, generator=gen)
               for name, t in whole.items()}  # fmt: skip
    in_place: dict[str, list[tuple[int, int]]] = {name: [] for name in whole}

    def covered(name: str) -> object:
        return lambda a, b: a >= b or any(s <= a and b <= e for s, e in _merged(tuple(in_place[name])))

    tail = residual_tail_bytes(codec, tokens, HEADS, DIM)
    reader = ExactRequestReader(codec, LAYERS, tokens, HEADS, DIM, tail)
    k_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    events = [event for part in landings[:-1] for event in part]
    order = torch.randperm(len(events), generator=gen).tolist() if seed else list(range(len(events)))
    ahead = 0
    for i in order:  # every part but the last, in a random order of streams and parts
        name, spans = events[i]
        for at, n in spans:
            staging[name][at : at + n] = whole[name][at : at + n]
            in_place[name].append((at, at + n))
        prefix = next((e for s, e in _merged(tuple(in_place["exact"])) if s == 0), 0)
        ahead += reader.take(staging["exact"].numpy(), prefix, staging["anchor"], covered("anchor"),  # type: ignore[arg-type]
                             staging["residual"], covered("residual"), k_out, v_out)  # type: ignore[arg-type]
    assert reader.restored == ahead
    if len(landings) > 2 and tokens > 2 * page_tokens:
        assert ahead > 0, "nothing was restored before the last part landed"
    for name, t in whole.items():
        staging[name][: t.numel()] = t
    anchor = staging["anchor"][: whole["anchor"].numel()]
    residual = residual_from_wire(anchor, staging["residual"][: whole["residual"].numel()], codec, LAYERS, tokens,
                                  HEADS, DIM)  # fmt: skip
    reader.finish(staging["exact"][: whole["exact"].numel()].numpy(), anchor, residual, k_out, v_out)
    assert reader.restored_rows == 2 * LAYERS * tokens  # every row once
    assert_same_kv(k_out, v_out, ks, vs)


def test_finish_refuses_a_stream_without_its_end_and_a_piece_twice_is_refused() -> None:
    codec = get_codec("lynx-exact", page_tokens=64)
    ks, vs = request_kv(200)
    landings, whole = _streamed(ks, vs, codec, 64, torch.Generator().manual_seed(0))
    exact = whole["exact"].numpy().tobytes()
    anchor = whole["anchor"]
    residual = residual_from_wire(anchor, whole["residual"], codec, LAYERS, 200, HEADS, DIM)
    out = [torch.zeros(200, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    reader = ExactRequestReader(codec, LAYERS, 200, HEADS, DIM, residual_tail_bytes(codec, 200, HEADS, DIM))
    with pytest.raises(ExactStreamError, match="does not end"):
        reader.finish(exact[:-8], anchor, residual, out, out)
    first_piece_end = landings[0][2][1][0][1]
    twice = exact[:first_piece_end] + exact[4:first_piece_end] + exact[first_piece_end:]
    reader = ExactRequestReader(codec, LAYERS, 200, HEADS, DIM)
    with pytest.raises(ExactStreamError, match="does not fit"):
        reader.finish(twice, anchor, residual, out, out)



@pytest.mark.parametrize("complete", [False, True], ids=["last-part-completes", "groups-complete"])
def test_pieces_coded_on_threads_give_the_same_streams_and_kv(complete: bool) -> None:
    """``run_pieces`` on a pool (jobs started last first): the writer's bytes and the reader's tensors are those
    of the calling thread's runner, so ``exact_threads`` changes nothing on the wire or in the pool."""
    tokens, page_tokens = 300, 64
    codec = get_codec("lynx-exact", page_tokens=page_tokens, chunk_tokens=32)
    ks, vs = request_kv(tokens)
    with ThreadPoolExecutor(3) as pool:
        runner = _reversed_on(pool)
        _, plain = _streamed(ks, vs, codec, page_tokens, torch.Generator().manual_seed(5), complete)
        landings, whole = _streamed(ks, vs, codec, page_tokens, torch.Generator().manual_seed(5), complete, runner)
        for name, t in plain.items():
            assert torch.equal(whole[name], t), name
        tail = residual_tail_bytes(codec, tokens, HEADS, DIM)
        reader = ExactRequestReader(codec, LAYERS, tokens, HEADS, DIM, tail, run_pieces=runner)
        k_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        v_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        everything = lambda a, b: True  # noqa: E731 - the whole streams are in place
        reader.take(whole["exact"].numpy(), len(whole["exact"]) // 2, whole["anchor"], everything,  # type: ignore[arg-type]
                    whole["residual"], everything, k_out, v_out)  # type: ignore[arg-type]
        ahead = reader.restored
        residual = residual_from_wire(whole["anchor"], whole["residual"], codec, LAYERS, tokens, HEADS, DIM)
        reader.finish(whole["exact"].numpy(), whole["anchor"], residual, k_out, v_out)
    assert 0 < ahead < reader.restored and reader.restored_rows == 2 * LAYERS * tokens
    assert_same_kv(k_out, v_out, ks, vs)


class _IntoOnly:
    """A per-layer exact codec that decodes only into the caller's tensor (``DECODES_INTO``), counting it."""

    DECODES_INTO = True

    def __init__(self) -> None:
        self.into = 0

    def encode_exact(self, *args: Any, **kwargs: Any) -> bytes:
        return lynx_exact.encode_exact(*args, **kwargs)

    def decode_exact(self, enc: Any, data: Any, params: Any, *, blocks: bool, out: torch.Tensor) -> torch.Tensor:
        self.into += 1
        return out.copy_(lynx_exact.decode_exact(enc, data, params, blocks=blocks))


def test_a_codec_that_decodes_into_tensors_writes_each_piece_into_its_rows() -> None:
    """``DECODES_INTO``: each piece decoded straight into the caller's rows (no tensor of its own), same KV."""
    tokens, page_tokens = 200, 64
    codec = get_codec("lynx-exact", page_tokens=page_tokens, chunk_tokens=32)
    ks, vs = request_kv(tokens)
    _, whole = _streamed(ks, vs, codec, page_tokens, torch.Generator().manual_seed(3))
    impl = _IntoOnly()
    reader = ExactRequestReader(codec, LAYERS, tokens, HEADS, DIM, residual_tail_bytes(codec, tokens, HEADS, DIM), impl)
    k_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_out = [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    residual = residual_from_wire(whole["anchor"], whole["residual"], codec, LAYERS, tokens, HEADS, DIM)
    reader.finish(whole["exact"].numpy(), whole["anchor"], residual, k_out, v_out)
    assert impl.into == reader.restored > 0
    assert_same_kv(k_out, v_out, ks, vs)
