"""A whole request through ``lynx-exact``'s three streams into a bf16 KV pool: byte-equal to the prefill KV.

Pool slots as SGLang hands them out at page size 1 (scattered) and 64 (runs of 64 slots); partial
pages, the sink token, ±0 and subnormals in the KV; the 8-bit values a ``lynx`` decode wrote before
are overwritten. Unit tier: the codec functions the transport will call, no servers.
"""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.exact_request import decode_exact_request_into, encode_exact_request, split_exact_request
from sglang_lynx.codec.lynx_exact import ExactStreamError
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import decode_request_into, encode_request

LAYERS, HEADS, DIM, POOL_SLOTS = 3, 3, 64, 2048


def request_kv(tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks, vs = [], []
    for layer in range(LAYERS):
        k, v = outlier_kv(tokens, HEADS, DIM, seed=layer), outlier_kv(tokens, HEADS, DIM, seed=100 + layer) * 0.1
        k[tokens // 2, 0, :3] = torch.tensor([0.0, -0.0, 1e-40])
        v[tokens - 1, 2, :2] = torch.tensor([-1e-39, -0.0])
        ks.append(k.to(torch.bfloat16))
        vs.append(v.to(torch.bfloat16))
    return ks, vs


def slots(tokens: int, page_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens + page_size)
    pages = torch.randperm(POOL_SLOTS // page_size, generator=gen)[: -(-tokens // page_size)]
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)[:tokens].to(torch.int64)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("tokens", [1, 100, 300])
def test_three_streams_restore_the_prefill_kv_byte_for_byte(page_size: int, tokens: int) -> None:
    codec = get_codec("lynx-exact", page_tokens=256)
    ks, vs = request_kv(tokens)
    payload = encode_request(ks, vs, codec)
    exact = encode_exact_request(ks, vs, payload, codec)
    k_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    where = slots(tokens, page_size)
    decode_request_into(payload, k_pool, v_pool, where, with_residual=False, codec=codec)  # the anchor stage
    decode_exact_request_into(payload.anchor, payload.residual, exact, k_pool, v_pool, where, codec=codec)
    for layer in range(LAYERS):
        assert torch.equal(k_pool[layer][where].view(torch.int16), ks[layer].view(torch.int16))
        assert torch.equal(v_pool[layer][where].view(torch.int16), vs[layer].view(torch.int16))
    untouched = torch.ones(POOL_SLOTS, dtype=torch.bool)
    untouched[where] = False
    assert all(int(pool[untouched].view(torch.int16).abs().sum()) == 0 for pool in (*k_pool, *v_pool))
    values = 2 * LAYERS * tokens * HEADS * DIM
    assert len(exact) * 8 / values < 16, "the exact stream costs more than BF16"


def test_bad_pools_and_streams_are_refused() -> None:
    codec = get_codec("lynx-exact")
    ks, vs = request_kv(40)
    payload = encode_request(ks, vs, codec)
    exact = encode_exact_request(ks, vs, payload, codec)
    where = torch.arange(40, dtype=torch.int64)
    fp32 = [torch.zeros(64, HEADS, DIM) for _ in range(LAYERS)]
    with pytest.raises(TypeError, match="bf16"):
        decode_exact_request_into(payload.anchor, payload.residual, exact, fp32, fp32, where, codec=codec)
    bf16 = [torch.zeros(64, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(ExactStreamError):
        decode_exact_request_into(payload.anchor, payload.residual, exact[:-1], bf16, bf16, where, codec=codec)
    with pytest.raises(ExactStreamError, match="2 layers"):
        split_exact_request(exact, 2)
    with pytest.raises(ValueError, match="no exact stream"):
        encode_exact_request(ks, vs, payload, get_codec("lynx"))
    with pytest.raises(ValueError, match="do not fit"):
        decode_exact_request_into(payload.anchor[:-1], payload.residual, exact, bf16, bf16, where, codec=codec)
