"""The lynx-exact C path's fast bin bounds (``fast_lower`` in ``kernels/lynx_exact_cpu.c``) change no byte.

Each bound comes from a float guess checked by error bounds and one evaluation of the encoder's float32 code;
the window search the C path used before is its fallback. Checked here: every bound the fast path decides
equals the window search's (both builds, random fp16 group statistics of every kind and every code a corrupt
stream can spell), the fallbacks are counted and rare on keys-like KV, and the exact streams of adversarial
KV (every exponent, subnormals, ±0, constant pages and groups, tiny groups beside large ones) are the bytes
of the reference and the planes recorded before the fast path (commit 25f4921), decoded bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib

import numpy as np
import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels import lynx_exact_cpu

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.registry import get_codec

pytestmark = pytest.mark.kernels
PARAMS = [{}, {"page_tokens": 64, "key_chunk_tokens": 32, "value_group_size": 32, "sink_tokens": 0}]
#: sha256 (first 16 hex) of escapes + decompressed planes, by the C path at 25f4921 (before the fast bounds).
PLANES_BEFORE = {
    ("wide", 0, "k"): "89f0cb8c5ca289c1", ("wide", 0, "v"): "34fe82599477d0b4",
    ("wide", 1, "k"): "2cbd5555797634ea", ("wide", 1, "v"): "c0a97c11b8ff3a82",
    ("near_zero", 0, "k"): "29a2549a3bb15f0a", ("near_zero", 0, "v"): "29a2549a3bb15f0a",
    ("near_zero", 1, "k"): "3c067aab2d023b82", ("near_zero", 1, "v"): "3c067aab2d023b82",
    ("mixed", 0, "k"): "5a88acfd38c64834", ("mixed", 0, "v"): "2e0dd27d3e2ce61b",
    ("mixed", 1, "k"): "20fae47b618330ef", ("mixed", 1, "v"): "6711f335ab40527d",
    ("scales", 0, "k"): "6c09b74eada2bae7", ("scales", 0, "v"): "d81e06c8f071b1a8",
    ("scales", 1, "k"): "a95a81892a9a7486", ("scales", 1, "v"): "28423413d1fbd571",
}  # fmt: skip


@functools.cache
def libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The default build (AVX-512 where the CPU has it) and the value-by-value one."""
    return lynx_exact_cpu.library(), lynx_exact_cpu.load(lynx_exact_cpu.build(("-DLYNX_EXACT_SCALAR",)))


def _bf16(bits: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16).reshape(shape).copy()).view(torch.bfloat16)


def adversarial_kv() -> dict[str, torch.Tensor]:
    """BF16 KV [300, 3, 64] from numpy's legacy RandomState (a stream numpy keeps stable)."""
    rs = np.random.RandomState(15)
    shape = (300, 3, 64)
    n = int(np.prod(shape))
    sign = rs.randint(0, 2, n) << 15
    out = {
        "wide": _bf16(sign | (rs.randint(0, 141, n) << 7) | rs.randint(0, 128, n), shape),  # every exponent < 2^14
        "near_zero": _bf16(sign | (rs.randint(0, 3, n) << 7) | rs.randint(0, 128, n), shape),  # subnormals, ±0
    }
    x = rs.normal(0, 1, shape) * (rs.rand(3, 64) * 3 + 0.1) + rs.normal(0, 2, (3, 64))
    x[:, 0, 5] += 40.0
    t = torch.from_numpy(x.astype(np.float32))
    flat = t.view(-1)
    at = rs.randint(0, n, 400)
    flat[at[:100]], flat[at[100:200]], flat[at[200:300]], flat[at[300:]] = 0.0, -0.0, 1e-40, -3e-39
    t[:64] = 7.0  # a constant page (page_tokens 64) and constant key chunks
    t[64:96, 1] = -0.0  # constant groups of -0 and +0
    t[96:128, 2] = 0.0
    out["mixed"] = t.to(torch.bfloat16)
    y = rs.normal(0, 1, shape).astype(np.float32)
    y[:, :, ::2] *= 1e-30  # tiny groups beside large ones
    y[:, 1] *= 20000.0 / max(1.0, float(np.abs(y[:, 1]).max()))
    out["scales"] = torch.from_numpy(y).clamp(-31000, 31000).to(torch.bfloat16)
    return out


def planes_digest(stream: bytes, values: int) -> str:
    index, bits, planes = lynx_exact.parse_stream(stream, values)
    return hashlib.sha256(index + bits + b"".join(b"|" + b"".join(p) for p in planes)).hexdigest()[:16]


@pytest.mark.parametrize("params", range(len(PARAMS)))
@pytest.mark.parametrize("kind", ["k", "v"])
def test_streams_are_the_bytes_before_the_fast_bounds(params: int, kind: str) -> None:
    codec = get_codec("lynx", **PARAMS[params])
    for name, x in adversarial_kv().items():
        enc = codec.encode(x, kind)  # type: ignore[arg-type]
        want = lynx_exact.encode_exact(x, enc, codec.params)
        assert planes_digest(want, x.numel()) == PLANES_BEFORE[(name, params, kind)]
        for lib in libraries():
            assert lynx_exact_cpu.encode_exact(x, enc, codec.params, lib=lib) == want, name
            back = lynx_exact_cpu.decode_exact(enc, want, codec.params, lib=lib)
            assert torch.equal(back.view(torch.int16), x.view(torch.int16)), name


def _fp16_values(rs: np.random.RandomState, n: int) -> np.ndarray:
    """Random finite fp16 values of every kind (subnormal, ±0, both signs, up to 65504) as float32."""
    bits = rs.randint(0, 1 << 16, n).astype(np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # Inf / NaN patterns -> finite ones
    return bits.view(np.float16).astype(np.float32)


def test_fast_bounds_equal_the_window_search() -> None:
    rs = np.random.RandomState(7)
    n = 400_000
    mn = np.concatenate([_fp16_values(rs, n), rs.normal(0, 3, n).astype(np.float16).astype(np.float32)])
    rng = np.concatenate([_fp16_values(rs, n), np.abs(rs.normal(0, 6, n)).astype(np.float16).astype(np.float32)])
    code = rs.randint(-8, 242, 2 * n)  # every code a corrupt residual can spell
    for lib in libraries():
        fast, ok, search = lynx_exact_cpu.lower_pairs(code, mn, rng, lib)
        assert (fast[ok] == search[ok]).all()
        assert not ok[(code < 1) | (code > 225) | (rng <= 0)].any()
        typical = ok[n:][(code[n:] >= 1) & (code[n:] <= 225) & (rng[n:] > 0)]
        assert typical.mean() > 0.99  # the fallback stays rare on ordinary statistics


def test_fallbacks_are_counted_and_rare_on_keys_like_kv() -> None:
    codec = get_codec("lynx")
    x = outlier_kv(512).to(torch.bfloat16)
    for lib in libraries():
        for kind in ("k", "v"):
            enc = codec.encode(x, kind)  # type: ignore[arg-type]
            before = lynx_exact_cpu.fallbacks(lib)
            lynx_exact_cpu.encode_exact(x, enc, codec.params, lib=lib)
            assert lynx_exact_cpu.fallbacks(lib) - before < 0.01 * 2 * x.numel()
        constant = torch.full((64, 3, 64), 7.0, dtype=torch.bfloat16)  # range 0: every bound falls back
        enc = codec.encode(constant, "v")
        before = lynx_exact_cpu.fallbacks(lib)
        stream = lynx_exact_cpu.encode_exact(constant, enc, codec.params, lib=lib)
        assert lynx_exact_cpu.fallbacks(lib) - before > 0
        assert stream == lynx_exact.encode_exact(constant, enc, codec.params)
