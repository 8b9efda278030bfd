"""The lynx-exact CPU fast path (``kernels/lynx_exact_cpu``): the reference's bytes and values.

Same exact stream as ``codec.lynx_exact.encode_exact`` (byte for byte) and the same BF16 tensor back,
on property-generated adversarial KV (±0, subnormals, constant stretches, huge and tiny magnitudes,
partial pages, sinks), on the reference's escapes, and the same errors for NaN and corrupt streams: both
builds, the default (AVX-512 where the CPU has it) and the scalar variant (`-DLYNX_EXACT_SCALAR`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_lynx.kernels import lynx_exact_cpu

from sglang_lynx.codec import exact_bins
from sglang_lynx.codec.lynx_exact import ExactStreamError, decode_exact, encode_exact
from sglang_lynx.codec.registry import get_codec

pytestmark = pytest.mark.kernels
SPECIALS = [0.0, -0.0, 1e-40, -1e-40, 1.2e-38, 6e-8, 1e-5, 31000.0, -31000.0, 1.0]


@functools.cache
def scalar_library() -> ctypes.CDLL:
    """The value-by-value variant (no AVX-512 path), built beside the default one."""
    return lynx_exact_cpu.load(lynx_exact_cpu.build(("-DLYNX_EXACT_SCALAR",)))


def same_as_reference(x: torch.Tensor, kind: str, **params: int) -> None:
    codec = get_codec("lynx", **params)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    fields = exact_bins.value_fields(enc.anchor, enc.residual, *x.shape, kind, codec.params)  # type: ignore[arg-type]
    ref_first, ref_size = exact_bins.bins(fields[2], fields[0], fields[1])
    want = encode_exact(x, enc, codec.params)
    for lib in (None, scalar_library()):  # the default build (AVX-512 where the CPU has it) and the scalar one
        first, size, _ = lynx_exact_cpu.bins(enc, codec.params, lib)
        assert (first == ref_first.reshape(-1).numpy()).all() and (size == ref_size.reshape(-1).numpy()).all()
        got = lynx_exact_cpu.encode_exact(x, enc, codec.params, lib=lib)
        assert got == want
        back = lynx_exact_cpu.decode_exact(enc, got, codec.params, lib=lib)
        assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def test_the_builds_differ_where_they_should() -> None:
    """The default build takes the AVX-512 path on a CPU that has it, the scalar variant never does, and
    both pass the tables' self-check (the division-free estimate equals the reference's quotient)."""
    with open("/proc/cpuinfo") as info:
        avx512 = " avx512f " in f" {next((line for line in info if line.startswith('flags')), '')} "
    assert lynx_exact_cpu.library().lynx_exact_vector() == int(avx512)
    assert scalar_library().lynx_exact_vector() == 0
    assert lynx_exact_cpu.library().lynx_exact_self_check() == 1 == scalar_library().lynx_exact_self_check()


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, int]]:
    tokens, heads, dim = draw(st.integers(1, 300)), draw(st.integers(1, 3)), draw(st.sampled_from([16, 32, 64]))
    page = draw(st.sampled_from([16, 64, 256]))
    params = {"page_tokens": page, "chunk_tokens": draw(st.sampled_from([c for c in (4, 8, 32) if c <= page])),
              "key_chunk_tokens": draw(st.sampled_from([c for c in (4, 8, 32, 64) if c <= page])),
              "value_group_size": draw(st.sampled_from([8, 16, 32, 64])), "sink_tokens": draw(st.integers(0, 3))}
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-38, 1e-6, 1e-2, 1.0, 3000.0]))
    x = torch.randn(tokens, heads, dim, generator=gen) * scale + torch.randn(heads, dim, generator=gen) * scale
    flat = x.view(-1)
    for _ in range(draw(st.integers(0, 20))):
        flat[int(torch.randint(0, flat.numel(), (1,), generator=gen))] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()):
        x[: draw(st.integers(1, tokens))] = draw(st.sampled_from([0.0, -0.0, 7.0, -2e-39]))
    return x.clamp(-31000.0, 31000.0).to(torch.bfloat16), params


@settings(max_examples=50, deadline=None)
@given(cases(), st.sampled_from(["k", "v"]))
def test_fast_path_equals_the_reference(case: tuple[torch.Tensor, dict[str, int]], kind: str) -> None:
    x, params = case
    same_as_reference(x, kind, **params)


def test_fast_path_reproduces_the_reference_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value just below its group's minimum bin (a key sink left out of the statistics, sink 0 here so
    the stream must carry it): escaped by both, the same bytes."""
    x = torch.randn(64, 2, 32).to(torch.bfloat16)
    codec = get_codec("lynx", sink_tokens=0)
    enc = codec.encode(x, "k")
    bad = x.clone()
    bad[3, 0, 0] = -1000.0  # outside its group's [mn, mn + rng]: not in any bin the decoder knows
    want = encode_exact(bad, enc, codec.params)
    assert int.from_bytes(want[4:8], "little") >= 1
    got = lynx_exact_cpu.encode_exact(bad, enc, codec.params)
    assert got == want
    assert torch.equal(lynx_exact_cpu.decode_exact(enc, got, codec.params).view(torch.int16), bad.view(torch.int16))
    assert torch.equal(decode_exact(enc, got, codec.params).view(torch.int16), bad.view(torch.int16))


def test_fast_path_errors() -> None:
    x = torch.randn(70, 3, 64).to(torch.bfloat16)
    codec = get_codec("lynx")
    enc = codec.encode(x, "v")
    nan = x.clone()
    nan[9, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        lynx_exact_cpu.encode_exact(nan, enc, codec.params)
    exact = lynx_exact_cpu.encode_exact(x, enc, codec.params)
    with pytest.raises(ExactStreamError):
        lynx_exact_cpu.decode_exact(enc, exact[:-2], codec.params)
    with pytest.raises(ExactStreamError):
        lynx_exact_cpu.decode_exact(codec.encode(torch.randn(70, 3, 64).to(torch.bfloat16), "v"), exact, codec.params)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.sampled_from(["k", "v"]))
def test_corrupt_streams_fail_cleanly_and_alike(seed: int, flips: int, kind: str) -> None:
    """Flipped bytes anywhere in an exact stream: both implementations raise ExactStreamError or both
    return the same tensor (never a crash, never a disagreement)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(90, 2, 32, generator=gen) * 3).to(torch.bfloat16)
    codec = get_codec("lynx", page_tokens=64)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    data = bytearray(encode_exact(x, enc, codec.params))
    for at in torch.randint(0, len(data), (flips,), generator=gen).tolist():
        data[at] ^= int(torch.randint(1, 256, (1,), generator=gen))
    results = []
    def scalar(enc_: object, data_: bytes, params_: object) -> torch.Tensor:
        return lynx_exact_cpu.decode_exact(enc_, data_, params_, lib=scalar_library())  # type: ignore[arg-type]

    for decode in (decode_exact, lynx_exact_cpu.decode_exact, scalar):
        try:
            results.append(decode(enc, bytes(data), codec.params).view(torch.int16))
        except ExactStreamError:
            results.append(None)
    if any(r is None for r in results):
        assert all(r is None for r in results)
    else:
        assert all(torch.equal(results[0], r) for r in results[1:])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["k", "v"]), st.sampled_from([0.0, 0.002, 0.05, 0.5]))
def test_bins_of_garbage_metadata_agree(seed: int, kind: str, garbage: float) -> None:
    """Anchor and residual bytes partly random (fp16 NaN / Inf / subnormal / negative group statistics,
    codes outside 0..225): a NaN or Inf statistic is refused alike by the reference and both builds
    (ExactStreamError, for the bins, the encoder and the decoder); otherwise the AVX-512 bin search and the
    scalar one find the same bins for every value, and the reference's wherever the range is >= 0 and the
    code valid (elsewhere a bin means nothing and the stream's other checks reject what it yields)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(150, 2, 48, generator=gen) * 5).to(torch.bfloat16)
    codec = get_codec("lynx", page_tokens=64, sink_tokens=1)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    exact = encode_exact(x, enc, codec.params)
    streams = []
    for stream in (enc.anchor, enc.residual):
        noisy = stream.clone()
        flip = torch.rand(noisy.shape, generator=gen) < garbage
        noisy[flip] = torch.randint(0, 256, noisy.shape, generator=gen, dtype=torch.uint8)[flip]
        streams.append(noisy)
    bad = dataclasses.replace(enc, anchor=streams[0], residual=streams[1])
    mn, rng, code = exact_bins.value_fields(bad.anchor, bad.residual, *x.shape, kind, codec.params)  # type: ignore[arg-type]
    libs = (None, scalar_library())
    if not (bool(mn.isfinite().all()) and bool(rng.isfinite().all())):
        for lib in libs:
            with pytest.raises(ExactStreamError, match="NaN or Inf"):
                lynx_exact_cpu.bins(bad, codec.params, lib)
            with pytest.raises(ExactStreamError, match="NaN or Inf"):
                lynx_exact_cpu.encode_exact(x, bad, codec.params, lib=lib)
            with pytest.raises(ExactStreamError, match="NaN or Inf"):
                lynx_exact_cpu.decode_exact(bad, exact, codec.params, lib=lib)
        with pytest.raises(ExactStreamError, match="NaN or Inf"):
            encode_exact(x, bad, codec.params)
        with pytest.raises(ExactStreamError, match="NaN or Inf"):
            decode_exact(bad, exact, codec.params)
        return
    ref_first, ref_size = (b.reshape(-1).numpy() for b in exact_bins.bins(code, mn, rng))
    valid = ((rng >= 0) & (code >= 0) & (code <= 225)).reshape(-1).numpy()
    valid[: codec.params.sink_tokens * 2 * 48] = False
    vector, scalar = (lynx_exact_cpu.bins(bad, codec.params, lib) for lib in libs)
    assert (vector[0] == scalar[0]).all() and (vector[1] == scalar[1]).all()
    assert (vector[0][valid] == ref_first[valid]).all() and (vector[1][valid] == ref_size[valid]).all()
    assert garbage > 0 or valid.sum() == valid.size - codec.params.sink_tokens * 2 * 48


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_both_bit_packs_equal_a_plain_pack_at_every_length(bits: int) -> None:
    """16-bit and byte ranks packed low bits first, the last byte partial, for lengths around the vector steps."""
    lib = lynx_exact_cpu.library()
    per = 8 // bits
    gen = torch.Generator().manual_seed(bits)
    for n in [*range(1, 70), 127, 128, 129, 200]:
        ranks = torch.randint(0, 1 << bits, (n + 64,), generator=gen)  # slack past n, as the C side may read
        want = bytearray(-(-n // per))
        for i in range(n):
            want[i // per] |= int(ranks[i]) << ((i % per) * bits)
        r16, r8 = ranks.to(torch.int16).contiguous(), ranks.to(torch.uint8).contiguous()
        out16 = torch.zeros(len(want) + 8, dtype=torch.uint8)
        out8 = torch.zeros(len(want) + 8, dtype=torch.uint8)
        lib.lynx_exact_pack_bits(r16.data_ptr(), n, bits, out16.data_ptr(), None)
        lib.lynx_exact_pack_bits8(r8.data_ptr(), n, bits, out8.data_ptr())
        assert bytes(out16[: len(want)].tolist()) == bytes(want), (n, "16-bit ranks")
        assert bytes(out8[: len(want)].tolist()) == bytes(want), (n, "byte ranks")
