"""Page runs written in place by the C fast path (``lynx_cpu_pages``) against the torch reference's, on every span."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels.lynx_cpu_pages import encode_pages_into

from sglang_lynx.codec.layout import LayoutParams, stream_bytes
from sglang_lynx.codec.page_reuse_encode import ReferencePageEncoder, _block_spans
from sglang_lynx.codec.registry import get_codec

CASES = [
    (700, 3, 64, torch.bfloat16, LayoutParams(), 0),
    (512, 3, 64, torch.float16, LayoutParams(), 1),
    (75, 2, 32, torch.float32, LayoutParams(page_tokens=32, chunk_tokens=8, group_size=16, sink_tokens=2), 2),
    (40, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, sink_tokens=3), 3),
]


def _buffers(tokens: int, heads: int, dim: int, kind: str, params: LayoutParams) -> tuple[torch.Tensor, torch.Tensor]:
    a, r = stream_bytes("lynx", tokens, heads, dim, kind, params)  # the residual as computed
    return torch.zeros(a, dtype=torch.uint8), torch.zeros(r, dtype=torch.uint8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("tokens", "heads", "dim", "dtype", "params", "seed"), CASES)
def test_every_span_matches_the_reference(name, kind, tokens, heads, dim, dtype, params, seed) -> None:
    x = outlier_kv(tokens, heads, dim, seed=seed)
    x[0] += 50.0  # the sink: only page 0 is shaped by it
    x = x.to(dtype)
    codec = get_codec(name, **vars(params))
    spans = _block_spans(codec, tokens, heads, dim, kind)
    pages = len(spans)
    want_a, want_r = _buffers(tokens, heads, dim, kind, params)
    ReferencePageEncoder(codec).blocks_into(x, kind, 0, pages, 3, want_a, want_r)
    for first in range(pages):
        for count in range(1, pages - first + 1):
            got_a, got_r = _buffers(tokens, heads, dim, kind, params)
            encode_pages_into(x, kind, first, count, got_a, got_r, params=params, layer=3, codec_name=name)
            for p in range(pages):  # the span's pages written as the reference's, the others untouched
                (a0, a1), (r0, r1) = spans[p]
                inside = first <= p < first + count
                assert torch.equal(got_a[a0:a1], want_a[a0:a1] if inside else torch.zeros_like(got_a[a0:a1])), p
                assert torch.equal(got_r[r0:r1], want_r[r0:r1] if inside else torch.zeros_like(got_r[r0:r1])), p


def test_bad_spans_buffers_and_values_are_named() -> None:
    params = LayoutParams()
    x = outlier_kv(300, 3, 64).bfloat16()
    a, r = _buffers(300, 3, 64, "k", params)
    with pytest.raises(ValueError, match="not pages of 300 tokens"):
        encode_pages_into(x, "k", 1, 2, a, r, params=params)
    with pytest.raises(ValueError, match="anchor: expected a contiguous uint8 buffer"):
        encode_pages_into(x, "k", 0, 1, a[:10], r, params=params)
    x[290, 1, 5] = float("nan")
    a, r = _buffers(300, 3, 64, "v", params)
    with pytest.raises(ValueError, match="page 1"):
        encode_pages_into(x, "v", 1, 1, a, r, params=params, layer=4)
