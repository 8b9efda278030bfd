"""The residual on the wire leaves out what the anchor's trailer carries, and rebuilds byte for byte."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.layout import trailer_bytes
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import decode_request_into, encode_request, request_stream_bytes
from sglang_lynx.codec.wire_residual import (
    residual_from_wire,
    residual_tail_bytes,
    residual_to_wire,
    residual_wire_bytes,
)

LAYERS, HEADS, DIM = 2, 3, 64


def layers(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks = [outlier_kv(tokens, HEADS, DIM, seed + i).to(torch.bfloat16) for i in range(LAYERS)]
    vs = [outlier_kv(tokens, HEADS, DIM, seed + 50 + i).to(torch.bfloat16) for i in range(LAYERS)]
    return ks, vs


@pytest.mark.parametrize("name", ["lynx", "lynx-int8", "lynx-exact"])
@pytest.mark.parametrize("tokens", [1, 47, 48, 49, 300, 600])
def test_the_body_rebuilds_the_whole_residual_and_the_same_pool(name: str, tokens: int) -> None:
    codec = get_codec(name)
    ks, vs = layers(tokens, seed=tokens)
    payload = encode_request(ks, vs, codec)
    body = residual_to_wire(payload.residual, codec, LAYERS, tokens, HEADS, DIM)
    tail = residual_tail_bytes(codec, tokens, HEADS, DIM)
    recent = min(codec.params.recent_tokens, tokens)
    # a request of at most recent_tokens tokens sends its residual whole (never an empty residual stream)
    assert tail == (0 if tokens <= recent else trailer_bytes(codec.name, tokens, HEADS, DIM, codec.params))
    assert tail == (0 if tokens <= codec.params.recent_tokens else recent * HEADS * DIM // 2)
    wire = residual_wire_bytes(codec, LAYERS, tokens, HEADS, DIM)
    assert body.numel() == wire == payload.residual.numel() - 2 * LAYERS * tail
    assert body.numel() > 0
    whole = residual_from_wire(payload.anchor, body.clone(), codec, LAYERS, tokens, HEADS, DIM)
    assert torch.equal(whole, payload.residual)

    slots = torch.randperm(tokens + 5)[:tokens]
    pools = [[torch.zeros(tokens + 5, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)] for _ in range(4)]
    decode_request_into(payload, pools[0], pools[1], slots, with_residual=True, codec=codec)
    decode_request_into((payload.anchor, whole), pools[2], pools[3], slots, with_residual=True, codec=codec)
    for got, want in zip(pools[2] + pools[3], pools[0] + pools[1], strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_body_saves_four_bits_per_recent_token_value_at_one_k_tokens() -> None:
    codec = get_codec("lynx")
    tokens, layers_, heads = 1024, 30, 3
    anchor, whole = request_stream_bytes(codec, layers_, tokens, heads, DIM)
    body = residual_wire_bytes(codec, layers_, tokens, heads, DIM)
    values = 2 * layers_ * tokens * heads * DIM
    assert 8 * whole / values == 4.0
    assert 8 * body / values == pytest.approx(4.0 - 4 * 48 / 1024)
    assert 8 * (anchor + body) / values == pytest.approx(8.5 + 16 / 1024)  # header (sink) + 4 + 4 + 0.5 metadata


@pytest.mark.parametrize("name", ["int8", "kivi-int4", "lynx-paper", "lynx-int4", "bf16"])
def test_codecs_without_a_trailer_send_their_residual_unchanged(name: str) -> None:
    codec = get_codec(name)
    ks, vs = layers(300, seed=3)
    payload = encode_request(ks, vs, codec)
    assert residual_tail_bytes(codec, 300, HEADS, DIM) == 0
    assert residual_to_wire(payload.residual, codec, LAYERS, 300, HEADS, DIM) is payload.residual
    assert residual_wire_bytes(codec, LAYERS, 300, HEADS, DIM) == payload.residual.numel()


def test_wrong_sizes_are_refused_with_the_expected_sizes() -> None:
    codec = get_codec("lynx")
    ks, vs = layers(100, seed=4)
    payload = encode_request(ks, vs, codec)
    body = residual_to_wire(payload.residual, codec, LAYERS, 100, HEADS, DIM)
    with pytest.raises(ValueError, match="request residual has"):
        residual_to_wire(payload.residual[:-1], codec, LAYERS, 100, HEADS, DIM)
    with pytest.raises(ValueError, match="expected"):
        residual_from_wire(payload.anchor, body[:-1], codec, LAYERS, 100, HEADS, DIM)
    with pytest.raises(ValueError, match="expected"):
        residual_from_wire(payload.anchor[:-1], body, codec, LAYERS, 100, HEADS, DIM)
