"""Whole-request streams and decoding straight into an SGLang-like KV pool."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import (
    decode_request_into,
    encode_request,
    request_spans,
    request_stream_bytes,
    upgrade_request_into,
)

LAYERS, TOKENS, HEADS, DIM = 3, 300, 3, 64


def make_layers(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks = [outlier_kv(TOKENS, HEADS, DIM, seed + i).to(torch.bfloat16) for i in range(LAYERS)]
    vs = [outlier_kv(TOKENS, HEADS, DIM, seed + 100 + i).to(torch.bfloat16) for i in range(LAYERS)]
    return ks, vs


def empty_pool(slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return (
        [torch.zeros(slots, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)],
        [torch.zeros(slots, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)],
    )


@pytest.mark.parametrize("name", ["lynx", "int8", "kivi-int4", "bf16"])
def test_request_streams_are_in_documented_order(name: str) -> None:
    codec = get_codec(name)
    ks, vs = make_layers(0)
    payload = encode_request(ks, vs, codec)
    assert (payload.anchor.numel(), payload.residual.numel()) == request_stream_bytes(codec, LAYERS, TOKENS, HEADS, DIM)
    spans = request_spans(codec, LAYERS, TOKENS, HEADS, DIM)
    assert [(s.kind, s.layer) for s in spans] == [("k", 0), ("k", 1), ("k", 2), ("v", 0), ("v", 1), ("v", 2)]
    v1 = spans[4]
    assert torch.equal(
        payload.anchor[v1.anchor_offset : v1.anchor_offset + v1.anchor_bytes], codec.encode(vs[1], "v").anchor
    )


def test_decode_into_scattered_slots_then_upgrade_in_place() -> None:
    codec = get_codec("lynx")
    ks, vs = make_layers(1)
    payload = encode_request(ks, vs, codec)
    slots = torch.randperm(1000)[:TOKENS]
    k_pool, v_pool = empty_pool(1000)
    decode_request_into(payload, k_pool, v_pool, slots, with_residual=False, codec=codec)
    draft_v2 = codec.decode(codec.encode(vs[2], "v"), with_residual=False)
    assert torch.equal(v_pool[2][slots], draft_v2)
    draft_err = (k_pool[0][slots].float() - ks[0].float()).norm()
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert k_pool[0][untouched].abs().sum() == 0

    raw = (bytes(payload.anchor.numpy()), bytes(payload.residual.numpy()))
    upgrade_request_into(raw, k_pool, v_pool, slots, codec=codec)
    assert torch.equal(v_pool[2][slots], codec.decode(codec.encode(vs[2], "v"), with_residual=True))
    assert (k_pool[0][slots].float() - ks[0].float()).norm() < draft_err / 8
    assert k_pool[0][untouched].abs().sum() == 0


def test_request_errors_are_clear() -> None:
    codec = get_codec("lynx")
    ks, vs = make_layers(2)
    payload = encode_request(ks, vs, codec)
    k_pool, v_pool = empty_pool(TOKENS)
    slots = torch.arange(TOKENS)
    with pytest.raises(ValueError, match="payload is 3 layers"):
        decode_request_into(payload, k_pool[:2], v_pool[:2], slots, with_residual=True, codec=codec)
    with pytest.raises(ValueError, match="request anchor has"):
        decode_request_into(
            (bytes(payload.anchor.numpy())[:-5], None), k_pool, v_pool, slots, with_residual=False, codec=codec
        )
    with pytest.raises(ValueError, match="no residual bytes"):
        decode_request_into(
            (bytes(payload.anchor.numpy()), None), k_pool, v_pool, slots, with_residual=True, codec=codec
        )
    with pytest.raises(TypeError, match="slot_indices must be 1-D int64"):
        decode_request_into(payload, k_pool, v_pool, slots.int(), with_residual=True, codec=codec)
    with pytest.raises(ValueError, match="has no residual stream"):
        upgrade_request_into(payload, k_pool, v_pool, slots, codec=get_codec("int8"))
    with pytest.raises(ValueError, match="layer 1 k: shape"):
        encode_request([ks[0], ks[1][:-1]], vs[:2], codec)
