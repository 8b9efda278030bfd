"""The chain attention kernel (``kernels/lynx_chain_sdpa``) against this host's per-input torch SDPA loop.

Every output of the kernel equals, bit for bit, what the CPU backend's decode attention computes for that
input alone (``per_input_sdpa``, the calls of ``chain_sdpa_decode``), and every row's logsumexp equals the
flash op's (which shows the exp sums' order that bf16 outputs rarely do): key counts around every step of
torch's kernel (16- and 32-key vector steps, 512-key blocks), GQA and not, every kind of check input, 1 and 2
torch threads, any split of the work over threads, the [Hk, T, D] view. The self-check returns True here
and False, without raising, when anything differs. Bad input gets a clear error. On a CPU build without
AVX-512 the kernel is unavailable and these tests are skipped with that reason; the verify then keeps its
per-input SDPA loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import pytest
import torch
from sglang_lynx.kernels import lynx_chain_sdpa as cs

pytestmark = pytest.mark.kernels

# (prefix_len, n): the inputs' key counts S + 1 .. S + n end before, on and after 16, 32, 512, 1024 keys
LENGTHS = [(0, 1), (0, 2), (14, 4), (30, 4), (0, 64), (495, 20), (509, 16), (1007, 20), (1400, 16), (5600, 16),
           (5590, 64)]  # fmt: skip
HEADS = [(9, 3), (4, 4), (8, 1)]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    cs.build()
    if not cs.available():
        pytest.skip("this CPU build has no AVX-512 F/BW: the verify keeps its per-input SDPA loop")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _assert_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float | None,
                  threads: int | None = None, lse: bool = True) -> None:  # fmt: skip
    out, got_lse = cs.chain_sdpa_with_lse(q, k, v, prefix_len, scale, threads=threads)
    want = cs.per_input_sdpa(q, k, v, prefix_len, scale)
    differ = int((_bits(out) != _bits(want)).sum())
    assert differ == 0, f"{differ} of {out.numel()} outputs differ (largest {(out.float() - want.float()).abs().max()})"
    if lse:
        assert torch.equal(_bits(got_lse), _bits(cs.per_input_logsumexp(q, k, v, prefix_len, scale)))


@pytest.mark.parametrize("kind", cs.INPUT_KINDS)
@pytest.mark.parametrize("prefix_len,n", LENGTHS)
def test_every_output_equals_the_per_input_loop(kind: str, prefix_len: int, n: int) -> None:
    for heads, kv_heads in HEADS if prefix_len + n < 2000 else HEADS[:1]:
        q, k, v = cs.check_inputs(kind, n, prefix_len, heads, kv_heads, seed=prefix_len + n)
        _assert_exact(q, k, v, prefix_len, 0.125, lse=prefix_len + n < 2000)


@pytest.mark.parametrize("torch_threads", [1, 2])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_thread_counts_change_nothing(torch_threads: int, threads: int) -> None:
    """Torch's own thread count (a decode server here runs 2) and the kernel's split of the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        lengths = [(509, 16), (1400, 16), (30, 4), (1007, 20), (14, 14)]
        for kind, (prefix_len, n) in zip(cs.INPUT_KINDS, lengths, strict=True):
            q, k, v = cs.check_inputs(kind, n, prefix_len, seed=n)
            _assert_exact(q, k, v, prefix_len, 0.125, threads=threads)
    finally:
        torch.set_num_threads(before)


def test_views_scales_and_head_dims() -> None:
    """The [Hk, T, D] view the backend slices, a strided q (the backend's movedim), the default scale 1 / sqrt(D),
    another scale, D = 128 and D = 16."""
    q, k, v = cs.check_inputs("random", 16, 700, seed=3)
    want = cs.per_input_sdpa(q, k, v, 700, 0.125)
    got = cs.chain_sdpa(q, k.movedim(0, 1), v.movedim(0, 1), 700, 0.125, heads_first=True)
    assert torch.equal(_bits(got), _bits(want))
    strided_q = q.movedim(0, 1).contiguous().movedim(1, 0)
    assert torch.equal(_bits(cs.chain_sdpa(strided_q, k, v, 700, 0.125)), _bits(want))
    _assert_exact(q, k, v, 700, None)
    _assert_exact(q, k, v, 700, 0.0883883476)
    for dim in (128, 16):
        q, k, v = cs.check_inputs("wide", 8, 520, 4, 2, dim=dim, seed=dim)
        _assert_exact(q, k, v, 520, None)


def test_tail_score_is_where_expf_and_double_exp_differ() -> None:
    """The ``tail`` kind rests on it: on this glibc, expf and the double exp torch's scalar tail calls round
    exp(TAIL_SCORE) differently (so a torch that switched to expf would fail the self-check)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.expf.argtypes, libm.expf.restype = [ctypes.c_float], ctypes.c_float
    x = cs.TAIL_SCORE
    assert float(torch.tensor(x).bfloat16()) == x
    assert libm.expf(x) != float(torch.tensor(math.exp(x), dtype=torch.float32))


def test_self_check_holds_here_and_fails_softly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cs.matches_torch()
    assert cs.matches_torch(threads=2)
    real = cs.chain_sdpa_with_lse

    def one_bit_off(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(*args, **kwargs)  # type: ignore[arg-type]
        out.view(torch.int16)[-1, -1, -1] ^= 1
        return out, lse

    def lse_one_bit_off(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(*args, **kwargs)  # type: ignore[arg-type]
        lse.view(torch.int32)[0, 0] ^= 1
        return out, lse

    def broken(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("kernel failure")

    for fake in (one_bit_off, lse_one_bit_off, broken):
        monkeypatch.setattr(cs, "chain_sdpa_with_lse", fake)
        assert cs.matches_torch() is False
    monkeypatch.setattr(cs, "available", lambda: False)
    assert cs.matches_torch() is False


def test_bad_input_is_refused() -> None:
    q, k, v = cs.check_inputs("random", 4, 10)
    cases = [
        ((q.float(), k, v, 10), "bf16"),
        ((q[0], k, v, 10), "3-D"),
        ((q[:0], k[:10], v[:10], 10), "no inputs"),
        ((q, k[:12], v[:12], 10), "need 14"),  # the prefix is shorter than prefix_len says
        ((q, k, v, 11), "need 15"),
        ((q, k, v, -1), "prefix_len"),
        ((q, k, v, True), "prefix_len"),
        ((q, k[:, :2], v[:, :2], 10), "not a multiple"),
        ((q[..., :40], k[..., :40], v[..., :40], 10), "head dim 40"),
        ((q, k, v[:, :, :32], 10), "do not match"),
        ((q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 10), "contiguous"),
        ((q, k.float(), v, 10), "bf16"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            cs.chain_sdpa(*args, 0.125)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        cs.chain_sdpa(q, k, v, 10, float("nan"))
    with pytest.raises(ValueError, match="kind"):
        cs.check_inputs("nope", 1, 1)
