"""Many-row bf16 GEMMs that round every row exactly as this host's 1-row GEMM does (``lynx_rows_gemm.c``).

Why: the chain verify must compute each of its ``n`` rows exactly as a decode step computes that row alone
(``integration/decode/row_gemm.py``). A CPU bf16 GEMM over ``n`` rows does not promise that, so the verify
ran ``n`` 1-row GEMMs, reading every weight ``n`` times (~0.8 decode step per draft). The 1-row GEMM torch
runs here (oneDNN brgemm, ``avx512_core_bf16``) sums each output as one VDPBF16PS chain per chunk of K
values, adds the chunks' sums and rounds to bf16 (``lynx_rows_gemm.c`` writes it out). The C kernel does
exactly that for all rows in one pass over weights packed once into VDPBF16PS pairs.

Nothing about the host kernel is assumed: :func:`calibrate` finds the chunk length for a weight shape by
comparing the kernel with the host's own 1-row GEMM on inputs built so that any other order of additions
shows (large products that cancel, so the rounding of every partial sum reaches the result: a wrong chunk
length or order agrees on ~20-60% of outputs there, measured), and returns None where no candidate agrees
on every output; the caller then keeps the 1-row GEMMs. The tests compare the kernel with the 1-row GEMM on
random and adversarial inputs for the default model's shapes.

Lifecycle: :func:`build` compiles into the kernel cache (as ``lynx_cpu_fast``, keyed by source, flags
and CPU); :func:`library` loads it (``FastPathNotBuilt`` when absent); :func:`available` says whether this
build has the instructions (AVX512-BF16). Pure functions of tensors: no state, no threads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from .lynx_cpu_fast import CachedLibrary, FastPathNotBuilt

SOURCE = Path(__file__).with_name("lynx_rows_gemm.c")
BLOCK = 16  # outputs per vector: packed weights hold N rounded up to this
#: chunk lengths :func:`calibrate` tries, the one measured on this host first; 0: the whole K at once
CANDIDATE_CHUNKS = (512, 256, 1024, 0, 128, 2048, 64)
CALIBRATION_ROWS = 4
OneRowGemm = Callable[[Tensor, Tensor], Tensor]  # (x [1, K], w [N, K]) -> [1, N], the host's computation


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lynx_rows_gemm_available.argtypes, lib.lynx_rows_gemm_available.restype = [], ctypes.c_int
    lib.lynx_rows_pack.argtypes, lib.lynx_rows_pack.restype = [ptr, i64, i64, ptr], None
    lib.lynx_rows_gemm.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    lib.lynx_rows_gemm.restype = ctypes.c_int


LIBRARY = CachedLibrary("lynx_rows_gemm", SOURCE, "the verify's row GEMM kernel", _declare)
library_path, build, library = LIBRARY.path, LIBRARY.build, LIBRARY.load


def available() -> bool:
    """Whether the kernel is built and this CPU build has AVX512-BF16 (else: keep the 1-row GEMMs)."""
    try:
        return bool(library().lynx_rows_gemm_available())
    except (FastPathNotBuilt, OSError):
        return False


def _check_weight(weight: Tensor) -> None:
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"the row GEMM takes a 2-D bf16 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")  # fmt: skip
    if weight.shape[1] % 2:
        raise ValueError(f"the row GEMM needs an even K (pairs of values), got K = {weight.shape[1]}")


def pack(weight: Tensor) -> Tensor:
    """``weight`` [N, K] (bf16, CPU, K even) in the kernel's layout: [ceil(N / 16), K / 2, 16, 2] flat."""
    _check_weight(weight)
    n, k = weight.shape
    w = weight.contiguous()
    packed = torch.empty((n + BLOCK - 1) // BLOCK * BLOCK * k, dtype=torch.bfloat16)
    library().lynx_rows_pack(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def gemm(x: Tensor, packed: Tensor, n: int, chunk: int) -> Tensor:
    """``x`` [M, K] bf16 times the packed [N, K] weight: [M, N] bf16, row i as the 1-row kernel computes it
    with this ``chunk`` (0: all of K in one chunk)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"the row GEMM takes 2-D bf16 CPU rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    if packed.numel() != (n + BLOCK - 1) // BLOCK * BLOCK * k:
        raise ValueError(f"packed weight of {packed.numel()} values does not fit N = {n}, K = {k}")
    rows = x.contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if library().lynx_rows_gemm(rows.data_ptr(), m, k, packed.data_ptr(), n, chunk if chunk > 0 else k,
                                out.data_ptr()):  # fmt: skip
        raise RuntimeError("the row GEMM kernel was built without AVX512-BF16 (check available() first)")
    return out


def adversarial_inputs(n: int, k: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(x [CALIBRATION_ROWS, K], w [N, K]) bf16 on which the order of additions shows: a third of each
    weight row is large (512-1024), a third its negated permutation, a third small; row 0 of x is ones, so
    its outputs are small sums left after large partial sums cancel (their roundings reach the result);
    the other rows are random."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.01
    third = max(1, k // 3)
    big = (torch.rand(n, third, generator=g) * 512 + 512).bfloat16().float()
    perm = torch.randperm(k, generator=g)
    w[:, perm[:third]] = big
    w[:, perm[third: 2 * third]] = -big[:, torch.randperm(third, generator=g)]
    x = torch.randn(CALIBRATION_ROWS, k, generator=g)
    x[0] = 1.0
    return x.bfloat16(), w.bfloat16()


def one_row_each(one_row: OneRowGemm, x: Tensor, w: Tensor) -> Tensor:
    """The host's 1-row GEMM applied to every row of ``x`` (what a decode step computes per row)."""
    return torch.cat([one_row(x[i: i + 1], w) for i in range(int(x.shape[0]))], dim=0)


def calibrate(n: int, k: int, one_row: OneRowGemm) -> int | None:
    """The chunk length with which :func:`gemm` equals ``one_row`` bit for bit on every output of
    :func:`adversarial_inputs` for an [N, K] weight, or None (then nothing here reproduces it)."""
    if not available() or k % 2:
        return None
    x, w = adversarial_inputs(n, k)
    want = one_row_each(one_row, x, w)
    if want.dtype != torch.bfloat16 or tuple(want.shape) != (x.shape[0], n):
        return None
    packed = pack(w)
    for chunk in CANDIDATE_CHUNKS:
        if chunk and (chunk % 2 or chunk >= k):
            continue
        if torch.equal(gemm(x, packed, n, chunk).view(torch.int16), want.view(torch.int16)):
            return chunk
    return None
