"""Page blocks from the C fast path (``lynx_cpu_pages``) against the torch reference's, on every span."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels.lynx_cpu_pages import encode_page_blocks

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.page_reuse_encode import ReferencePageEncoder
from sglang_lynx.codec.registry import get_codec

CASES = [
    (700, 3, 64, torch.bfloat16, LayoutParams(), 0),
    (512, 3, 64, torch.float16, LayoutParams(), 1),
    (75, 2, 32, torch.float32,
     LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8, group_size=16, sink_tokens=2), 2),
    (40, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, key_chunk_tokens=4, sink_tokens=3), 3),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("tokens", "heads", "dim", "dtype", "params", "seed"), CASES)
def test_every_span_matches_the_reference(name, kind, tokens, heads, dim, dtype, params, seed) -> None:
    x = outlier_kv(tokens, heads, dim, seed=seed)
    x[0] += 50.0  # the sink: only page 0 is shaped by it
    x = x.to(dtype)
    pages = -(-tokens // params.page_tokens)
    want = ReferencePageEncoder(get_codec(name, **vars(params))).blocks(x, kind, 0, pages, 3)
    for first in range(pages):
        for count in range(1, pages - first + 1):
            got = encode_page_blocks(x, kind, first, count, params=params, layer=3, codec_name=name)
            assert len(got) == count
            for (a, r), (ra, rr) in zip(got, want[first : first + count], strict=True):
                assert torch.equal(a, ra) and torch.equal(r, rr), (first, count)


def test_bad_spans_and_values_are_named() -> None:
    params = LayoutParams()
    x = outlier_kv(300, 3, 64).bfloat16()
    with pytest.raises(ValueError, match="not pages of 300 tokens"):
        encode_page_blocks(x, "k", 1, 2, params=params)
    x[290, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="page 1"):
        encode_page_blocks(x, "v", 1, 1, params=params, layer=4)
