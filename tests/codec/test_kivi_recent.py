"""KIVI's full-precision residual (``kivi_recent_tokens``): the last R tokens ride in bf16 in the anchor's trailer."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.layout import bits_per_value, stream_bytes
from sglang_lynx.codec.page_cache import EncodedPageCache, prefix_page_hashes
from sglang_lynx.codec.page_reuse_encode import encode_with_cache
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig, LynxConfigError


@pytest.mark.parametrize("name", ["kivi-int4", "kivi-int2"])
@pytest.mark.parametrize("recent", [0, 5, 32, 300])
@pytest.mark.parametrize("tokens", [1, 40, 300])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_the_last_tokens_decode_exactly_and_the_others_as_without(name: str, recent: int, tokens: int,
                                                                  kind: str) -> None:
    x = outlier_kv(tokens, 2, 32, seed=tokens + recent).to(torch.bfloat16)
    codec = get_codec(name, page_tokens=64, kivi_recent_tokens=recent)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    assert (enc.anchor.numel(), enc.residual.numel()) == stream_bytes(name, tokens, 2, 32, kind, codec.params)  # type: ignore[arg-type]
    plain = get_codec(name, page_tokens=64).encode(x, kind)  # type: ignore[arg-type]
    count = min(recent, tokens)
    assert enc.anchor.numel() == plain.anchor.numel() + count * 2 * 32 * 2  # + bf16 values of the recent tokens
    assert torch.equal(enc.anchor[: plain.anchor.numel()], plain.anchor)  # the pages are unchanged
    got = codec.decode(enc, with_residual=False)
    want = get_codec(name, page_tokens=64).decode(plain, with_residual=False)
    assert torch.equal(got[tokens - count :].view(torch.int16), x[tokens - count :].view(torch.int16))
    assert torch.equal(got[: tokens - count].view(torch.int16), want[: tokens - count].view(torch.int16))


def test_the_window_costs_its_bf16_bits_and_only_kivi_has_one() -> None:
    with_window = bits_per_value("kivi-int4", 1024, 3, 64, get_codec("kivi-int4", kivi_recent_tokens=32).params)
    assert with_window[0] == pytest.approx(4.75 + (16 * 32) / 1024)
    for name in ("int4", "int8", "lynx", "bf16"):
        params = get_codec(name, kivi_recent_tokens=32).params
        assert bits_per_value(name, 1024, 3, 64, params) == bits_per_value(name, 1024, 3, 64)


def test_the_encoded_page_cache_gives_the_same_bytes_with_a_window() -> None:
    codec = get_codec("kivi-int4", page_tokens=32, chunk_tokens=8, kivi_recent_tokens=7)
    cache = EncodedPageCache(max_bytes=1 << 24)
    x = outlier_kv(100, 2, 32, seed=3)
    hashes = prefix_page_hashes(list(range(100)), 32)
    for _ in range(2):  # cold, then from the cache
        got = encode_with_cache(codec, x, "k", 0, hashes, cache)
        assert torch.equal(got.anchor, codec.encode(x, "k").anchor)
    assert cache.hits == 3


def test_the_config_field_is_validated_and_reaches_the_codec() -> None:
    config = LynxConfig(mode="kivi-int4", kivi_recent_tokens=128)
    assert get_codec(config.codec_name, **config.codec_params()).params.kivi_recent_tokens == 128
    with pytest.raises(LynxConfigError, match="kivi_recent_tokens"):
        LynxConfig(mode="kivi-int4", kivi_recent_tokens=-1)


def test_the_transport_codec_path_carries_the_window_into_the_pool() -> None:
    from sglang_lynx.integration.transport.codec import decode_request_streams, encode_request_streams

    config = LynxConfig(mode="kivi-int4", kivi_recent_tokens=32)
    codec = get_codec(config.codec_name, **config.codec_params())
    k = [outlier_kv(300, 3, 64, seed=i).to(torch.bfloat16) for i in range(2)]
    v = [outlier_kv(300, 3, 64, seed=10 + i).to(torch.bfloat16) for i in range(2)]
    anchor, residual = encode_request_streams(k, v, codec, config)
    slots = torch.randperm(320)[:300]
    k_pool, v_pool = [torch.zeros(320, 3, 64, dtype=torch.bfloat16) for _ in range(2)], [
        torch.zeros(320, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    decode_request_streams(anchor, None, k_pool, v_pool, slots, codec, config)
    for src, pool in zip(k + v, k_pool + v_pool, strict=True):
        assert torch.equal(pool[slots[-32:]].view(torch.int16), src[-32:].view(torch.int16))
        assert not torch.equal(pool[slots[:-32]].view(torch.int16), src[:-32].view(torch.int16))
