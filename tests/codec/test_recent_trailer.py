"""``lynx``'s layer trailer: the last ``recent_tokens`` tokens decode at full precision from the anchor alone."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.layout import LayoutParams, bits_per_value, stream_bytes, trailer_bytes
from sglang_lynx.codec.page_cache import EncodedPageCache, prefix_page_hashes
from sglang_lynx.codec.page_reuse_encode import encode_with_cache
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig, LynxConfigError

SMALL = {"page_tokens": 32, "chunk_tokens": 8, "key_chunk_tokens": 8, "value_group_size": 16, "sink_tokens": 2}


@pytest.mark.parametrize("name", ["lynx", "lynx-int4", "lynx-int8"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("tokens", "recent"), [(100, 20), (100, 40), (64, 32), (7, 20), (1, 1), (0, 5), (90, 0)])
def test_anchor_only_decode_is_full_precision_on_the_recent_tokens(name, kind, tokens, recent) -> None:
    x = outlier_kv(tokens, 2, 32, seed=tokens + recent).to(torch.bfloat16)
    codec = get_codec(name, recent_tokens=recent, **SMALL)
    plain = get_codec("lynx", recent_tokens=0, **SMALL)
    enc, ref = codec.encode(x, kind), plain.encode(x, kind)
    tail = min(recent, tokens)
    extra = tail * 2 * 32 // 2
    assert enc.anchor.numel() == ref.anchor.numel() + extra
    assert torch.equal(enc.anchor[: ref.anchor.numel()], ref.anchor)  # header and pages unchanged
    if extra:  # the trailer is the residual stream's last bytes
        assert torch.equal(enc.anchor[ref.anchor.numel() :], ref.residual[-extra:])
    assert (enc.anchor.numel(), enc.residual.numel()) == stream_bytes(name, tokens, 2, 32, kind, codec.params)
    got = codec.decode(enc, with_residual=False, dtype=torch.float32)
    want = plain.decode(ref, with_residual=False, dtype=torch.float32)
    full = plain.decode(ref, with_residual=True, dtype=torch.float32)
    assert torch.equal(got[: tokens - tail], want[: tokens - tail])
    assert torch.equal(got[tokens - tail :], full[tokens - tail :])
    if tail and tokens > 2:
        assert not torch.equal(got, want)  # the trailer made a difference
    if name != "lynx-int4":
        assert torch.equal(codec.decode(enc, with_residual=True, dtype=torch.float32), full)


@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
@pytest.mark.parametrize("tokens", [100, 96, 20])
def test_cached_encoding_with_a_trailer_is_byte_identical(name, tokens) -> None:
    codec = get_codec(name, recent_tokens=40, **SMALL)
    x = outlier_kv(tokens, 2, 32, seed=3)
    cache = EncodedPageCache(max_bytes=1 << 24)
    hashes = prefix_page_hashes(list(range(tokens)), 32)
    for _ in range(2):  # cold, then every full page a hit
        for kind in ("k", "v"):
            got = encode_with_cache(codec, x, kind, 0, hashes, cache)
            want = codec.encode(x, kind)
            assert torch.equal(got.anchor, want.anchor) and torch.equal(got.residual, want.residual)
            assert torch.equal(codec.encode_trailer(x, kind), want.anchor[want.anchor.numel() - trailer_bytes(
                name, tokens, 2, 32, codec.params):])
    assert cache.hits > 0 or tokens < 32


def test_trailer_costs_four_bits_per_recent_value() -> None:
    base = bits_per_value("lynx", 1024, 3, 64, LayoutParams(recent_tokens=0))
    more = bits_per_value("lynx", 1024, 3, 64, LayoutParams(recent_tokens=32))
    assert more[0] == pytest.approx(base[0] + 4 * 32 / 1024) and more[1] == base[1] == 4.0
    assert bits_per_value("kivi-int4", 1024, 3, 64, LayoutParams(recent_tokens=32)) == bits_per_value(
        "kivi-int4", 1024, 3, 64
    )


def test_recent_tokens_is_validated_and_reaches_the_codec() -> None:
    with pytest.raises(ValueError, match="recent_tokens"):
        LayoutParams(recent_tokens=-1)
    with pytest.raises(LynxConfigError, match="recent_tokens"):
        LynxConfig(recent_tokens=-3)
    with pytest.raises(LynxConfigError, match="recent_tokens"):
        LynxConfig.from_dict({"recent_tokens": 2.5})
    cfg = LynxConfig(recent_tokens=48)
    assert get_codec(cfg.codec_name, **cfg.codec_params()).params.recent_tokens == 48
