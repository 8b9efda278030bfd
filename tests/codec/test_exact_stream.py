"""The ``lynx-exact`` stream (``codec.lynx_exact``): lynx anchor + residual + exact -> the original BF16 bits.

Byte-exact round trips on property-generated and adversarial KV (±0, subnormals, constant pages and
groups, partial pages, sinks, huge and tiny magnitudes), bins checked against brute force over every
BF16 value, losslessness when the boundary window is disabled (every value escaped), and the errors
of bad input and corrupt streams.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch
from codec_inputs import outlier_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_lynx.codec import exact_bins, lynx_exact
from sglang_lynx.codec.lynx_exact import ExactStreamError, decode_exact, encode_exact
from sglang_lynx.codec.registry import get_codec


def round_trip(x: torch.Tensor, kind: str, **params: int) -> bytes:
    codec = get_codec("lynx", **params)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    exact = encode_exact(x, enc, codec.params)
    back = decode_exact(enc, exact, codec.params)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.equal(back.view(torch.int16), x.view(torch.int16)), "exact stream is not bit-exact"
    return exact


SPECIALS = torch.tensor(
    [0.0, -0.0, 1e-40, -1e-40, 9.2e-41, 1.2e-38, -1.1e-38, 6e-8, 1e-5, -3e-5, 31000.0, -31000.0, 1.0, -1.0],
    dtype=torch.float32,
)


@st.composite
def adversarial_kv(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, int]]:
    tokens = draw(st.integers(1, 300))
    heads = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([16, 32, 64]))
    page = draw(st.sampled_from([16, 64, 256]))
    params = {
        "page_tokens": page,
        "chunk_tokens": draw(st.sampled_from([c for c in (4, 8, 16, 32) if c <= page])),
        "key_chunk_tokens": draw(st.sampled_from([c for c in (4, 8, 16, 32, 64) if c <= page])),
        "value_group_size": draw(st.sampled_from([8, 16, 32, 64])),
        "sink_tokens": draw(st.integers(0, min(4, page))),
        "recent_tokens": draw(st.sampled_from([0, 1, 48, 1000])),
    }
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-38, 1e-6, 1e-2, 1.0, 50.0, 3000.0]))
    x = torch.randn(tokens, heads, dim, generator=gen) * scale * torch.rand(heads, dim, generator=gen)
    x += torch.randn(heads, dim, generator=gen) * scale * draw(st.floats(0, 10))
    flat = x.view(-1)
    specials = draw(st.integers(0, 40))
    if specials:
        flat[torch.randint(0, flat.numel(), (specials,), generator=gen)] = SPECIALS[
            torch.randint(0, SPECIALS.numel(), (specials,), generator=gen)
        ]
    if draw(st.booleans()):  # a constant stretch of tokens (constant groups and chunks)
        start = draw(st.integers(0, tokens - 1))
        x[start : start + draw(st.integers(1, 64))] = draw(st.sampled_from([0.0, -0.0, 1.5, -2.0e-39, 7.0]))
    return x.clamp(-31000.0, 31000.0).to(torch.bfloat16), params


@settings(max_examples=60, deadline=None)
@given(adversarial_kv(), st.sampled_from(["k", "v"]))
def test_exact_round_trip_is_bit_exact(case: tuple[torch.Tensor, dict[str, int]], kind: str) -> None:
    x, params = case
    round_trip(x, kind, **params)


@pytest.mark.parametrize("tokens", [1, 2, 31, 64, 255, 256, 257, 600])
@pytest.mark.parametrize("page_tokens", [16, 64, 256])
def test_partial_pages_and_sinks(tokens: int, page_tokens: int) -> None:
    x = outlier_kv(tokens, seed=tokens).to(torch.bfloat16)
    for kind in ("k", "v"):
        chunk = min(32, page_tokens)
        round_trip(x, kind, page_tokens=page_tokens, chunk_tokens=chunk, key_chunk_tokens=chunk)
        round_trip(x, kind, page_tokens=page_tokens, chunk_tokens=chunk, key_chunk_tokens=chunk, sink_tokens=0)


@pytest.mark.parametrize("fill", [0.0, -0.0, 1e-40, -3.0, 1.0e4])
def test_constant_page(fill: float) -> None:
    x = torch.full((300, 3, 64), fill, dtype=torch.bfloat16)
    for kind in ("k", "v"):
        exact = round_trip(x, kind)
        assert len(exact) < 200, f"a constant page costs {len(exact)} exact bytes"


def test_signed_zeros_and_subnormals_mixed() -> None:
    gen = torch.Generator().manual_seed(3)
    pool = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 5e-39, -5e-39, 1e-3], dtype=torch.float32)
    x = pool[torch.randint(0, pool.numel(), (128, 2, 32), generator=gen)].to(torch.bfloat16)
    for kind in ("k", "v"):
        round_trip(x, kind, page_tokens=64)


def test_bins_match_brute_force_over_every_bf16_value() -> None:
    """Every value's (L, n) equals the run of finite BF16 values in [mn, mn + rng] with the value's code."""
    x = outlier_kv(40, heads=2, dim=32, seed=7)
    x[3, 0, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-39])
    x = x.to(torch.bfloat16)
    codec = get_codec("lynx", page_tokens=64, value_group_size=32)
    for kind in ("k", "v"):
        enc = codec.encode(x, kind)
        mn, rng, code = exact_bins.value_fields(enc.anchor, enc.residual, 40, 2, 32, kind, codec.params)
        first, count = exact_bins.bins(code, mn, rng)
        ords = torch.arange(exact_bins.ORD_MIN_FINITE, exact_bins.ORD_MAX_FINITE + 1, dtype=torch.int32)
        values = exact_bins.ordinal_values(ords)
        for t, d in [(1, 0), (3, 0), (3, 1), (3, 2), (3, 3), (17, 5), (39, 31), (20, 11), (8, 30), (0, 7)]:
            m, r = mn[t, 0, d], rng[t, 0, d]
            inside = (values.double() >= m.double()) & (values.double() <= m.double() + r.double())
            same = inside & (exact_bins.code_of(values, m, r) == code[t, 0, d])
            members = ords[same]
            assert int(count[t, 0, d]) == members.numel()
            if members.numel():
                assert int(first[t, 0, d]) == int(members[0])
                assert int(members[-1] - members[0]) + 1 == members.numel()  # one contiguous run


def test_lossless_even_when_every_boundary_search_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Losslessness never rests on the window: with estimates 7 ordinals off (beyond the window) values escape."""
    x = outlier_kv(100, seed=11).to(torch.bfloat16)
    nearest = exact_bins._nearest_ordinal
    monkeypatch.setattr(exact_bins, "_nearest_ordinal", lambda target: nearest(target) + 7)
    codec = get_codec("lynx")
    enc = codec.encode(x, "k")
    exact = encode_exact(x, enc, codec.params)
    assert struct.unpack_from("<I", exact, 4)[0] > 0, "expected escapes with the estimates off"
    assert torch.equal(decode_exact(enc, exact, codec.params).view(torch.int16), x.view(torch.int16))


def test_ordinals_are_a_monotone_bijection() -> None:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    ords = exact_bins.ordinal(bits)
    assert torch.equal(torch.sort(ords).values, torch.arange(65536, dtype=torch.int32))
    assert torch.equal(exact_bins.from_ordinal(ords), bits)
    finite = torch.arange(exact_bins.ORD_MIN_FINITE, exact_bins.ORD_MAX_FINITE + 1, dtype=torch.int32)
    values = exact_bins.ordinal_values(finite).double()
    assert bool((values[1:] >= values[:-1]).all())
    neg0, pos0 = exact_bins.bf16_ordinals(torch.tensor([-0.0, 0.0], dtype=torch.bfloat16)).tolist()
    assert (neg0, pos0) == (0x7FFF, 0x8000)


def test_bad_input_and_corrupt_streams() -> None:
    x = outlier_kv(70, seed=1).to(torch.bfloat16)
    codec = get_codec("lynx")
    enc = codec.encode(x, "v")
    with pytest.raises(TypeError, match="bf16"):
        encode_exact(x.float(), enc, codec.params)
    bad = x.clone()
    bad[5, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_exact(bad, enc, codec.params)
    with pytest.raises(ValueError, match="refines the lynx codec"):
        encode_exact(x, get_codec("int8").encode(x, "v"), codec.params)
    with pytest.raises(ValueError, match="refines the lynx codec"):
        encode_exact(x, get_codec("lynx-int4").encode(x, "v"), codec.params)
    anchor_only = dataclasses.replace(enc, residual=enc.residual[:0])
    with pytest.raises(ValueError, match="whole residual"):
        encode_exact(x, anchor_only, codec.params)
    exact = encode_exact(x, enc, codec.params)
    with pytest.raises(ExactStreamError, match="magic"):
        decode_exact(enc, b"XXXX" + exact[4:], codec.params)
    with pytest.raises(ExactStreamError):
        decode_exact(enc, exact[:-3], codec.params)
    with pytest.raises(ExactStreamError):
        decode_exact(enc, exact[:5], codec.params)
    other = codec.encode(outlier_kv(70, seed=2).to(torch.bfloat16), "v")
    with pytest.raises(ExactStreamError, match="holds"):  # another layer's streams: its classes differ
        decode_exact(other, exact, codec.params)


def test_rank_classes_cover_every_count() -> None:
    covered = [c for rc in lynx_exact.RANK_CLASSES for c in range(rc.lo, rc.hi + 1)]
    assert covered == list(range(2, (1 << 16) + 1))
    for rc in lynx_exact.RANK_CLASSES:
        assert rc.hi <= 1 << rc.bits


def test_lynx_exact_codec_is_lynx_plus_the_exact_stream() -> None:
    x = outlier_kv(300, seed=5).to(torch.bfloat16)
    exact_codec, lynx_codec = get_codec("lynx-exact"), get_codec("lynx")
    for kind in ("k", "v"):
        enc, ref = exact_codec.encode(x, kind), lynx_codec.encode(x, kind)
        assert torch.equal(enc.anchor, ref.anchor) and torch.equal(enc.residual, ref.residual)
        back = exact_codec.decode_exact(enc, exact_codec.encode_exact(x, enc))  # type: ignore[attr-defined]
        assert torch.equal(back.view(torch.int16), x.view(torch.int16))
    with pytest.raises(ValueError, match="alpha"):
        get_codec("lynx-exact", alpha=3.0)
