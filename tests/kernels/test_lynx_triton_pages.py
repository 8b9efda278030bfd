"""The Triton page-range encode (``encode_pages_into``) and a request streamed through it in parts.

A CUDA prefill streams each chunk's pages as they arrive (``codec.stream_parts``) with the transport's
``KernelPageEncoder`` over these kernels: the page blocks must be the reference's, byte for byte, for
any split, and the parts must add up to the whole-request encode. Interpreted on the CPU here.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_inputs import outlier_kv

from sglang_lynx.codec.layout import LayoutParams, stream_bytes
from sglang_lynx.codec.page_reuse_encode import ReferencePageEncoder
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import encode_request
from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.codec.wire_residual import residual_to_wire
from sglang_lynx.integration.transport.codec import KernelPageEncoder

PARAMS = LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=16, value_group_size=16, sink_tokens=2,
                      recent_tokens=12)
LAYERS, HEADS, DIM = 2, 2, 32


def _buffers(tokens: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    a_len, r_len = stream_bytes("lynx", tokens, HEADS, DIM, kind, PARAMS)
    return torch.full((a_len,), 0xAB, dtype=torch.uint8), torch.full((r_len,), 0xCD, dtype=torch.uint8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["lynx", "lynx-int8", "lynx-int4"])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_page_ranges_write_exactly_the_reference_blocks(lynx_triton: ModuleType, name: str, kind: str) -> None:
    """Pages [0, 1), [1, 3), [3, 4) of 110 tokens (the last page partial), each range alone: the same bytes
    as the reference page encoder, and nothing outside the pages' blocks (header and trailer untouched)."""
    codec = get_codec(name, **vars(PARAMS))
    x = outlier_kv(110, HEADS, DIM, seed=11).to(torch.bfloat16)
    for first, count in ((0, 1), (1, 2), (3, 1)):
        got_a, got_r = _buffers(110, kind)
        want_a, want_r = _buffers(110, kind)
        lynx_triton.encode_pages_into(x, kind, first, count, got_a, got_r, params=PARAMS, layer=0, codec_name=name)
        ReferencePageEncoder(codec).blocks_into(x, kind, first, count, 0, want_a, want_r)
        assert torch.equal(got_a, want_a), f"pages [{first}, {first + count}): anchor bytes differ"
        assert torch.equal(got_r, want_r), f"pages [{first}, {first + count}): residual bytes differ"


@pytest.mark.timeout(120)
def test_page_range_errors(lynx_triton: ModuleType) -> None:
    x = outlier_kv(70, HEADS, DIM, seed=12)
    a, r = _buffers(70, "k")
    with pytest.raises(ValueError, match=r"pages \[2, 4\) are not pages of 70 tokens"):
        lynx_triton.encode_pages_into(x, "k", 2, 2, a, r, params=PARAMS)
    with pytest.raises(ValueError, match="anchor: expected a contiguous uint8 buffer"):
        lynx_triton.encode_pages_into(x, "k", 0, 1, a[:10], r, params=PARAMS)
    big = x.clone()
    big[40, 1, 5] = 70000.0  # page 1
    with pytest.raises(ValueError, match=r"layer 3 v page 1: \|value\| up to 70000"):
        lynx_triton.encode_pages_into(big, "v", 1, 2, *_buffers(70, "v"), params=PARAMS, layer=3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
def test_a_request_streamed_through_the_kernel_page_encoder_equals_the_whole_encode(lynx_triton: ModuleType,
                                                                                    name: str) -> None:
    """Chunks ending at 40, 70 and 110 tokens (inside pages) through ``PartEncoder`` over
    ``KernelPageEncoder``: the anchor and the residual body equal ``encode_request``'s; rows not yet
    received are NaN and never read."""
    codec = get_codec(name, **vars(PARAMS))
    tokens = 110
    ks = [outlier_kv(tokens, HEADS, DIM, seed=20 + i).to(torch.bfloat16) for i in range(LAYERS)]
    vs = [outlier_kv(tokens, HEADS, DIM, seed=30 + i).to(torch.bfloat16) for i in range(LAYERS)]
    want = encode_request(ks, vs, codec)
    parts = PartEncoder(KernelPageEncoder(lynx_triton, codec, PARAMS), LAYERS, tokens, HEADS, DIM)
    anchor = torch.full((parts.anchor_bytes,), 0xA5, dtype=torch.uint8)
    computed = parts.new_scratch()
    body = torch.full((parts.body_bytes,), 0x5A, dtype=torch.uint8) if parts.body_bytes else None
    k_in = [torch.full_like(x, float("nan")) for x in ks]
    v_in = [torch.full_like(x, float("nan")) for x in vs]
    received = 0
    for end in (40, 70, 110):
        for src, dst in zip(ks + vs, k_in + v_in, strict=True):
            dst[received:end] = src[received:end]
        received = end
        last = received >= tokens
        pages = parts.encodable_pages(received)
        if pages > parts.next_page or last:
            parts.encode_part(k_in, v_in, pages, last, anchor, computed, body)
    assert parts.done and torch.equal(anchor, want.anchor)
    if body is not None:
        assert torch.equal(body, residual_to_wire(want.residual, codec, LAYERS, tokens, HEADS, DIM))
