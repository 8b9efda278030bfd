"""Decode attention of all ``n`` inputs of a chain in one pass over K/V (``lynx_chain_sdpa.c``), bit for bit
what this host's torch SDPA computes for each input alone.

Why: the chain verify must compute each input exactly as a decode step does; the CPU backend's attention
did it with one SDPA call per input (``integration/decode/chain_attention.chain_sdpa_decode``), reading the
row's K/V ``n`` times, the verify's bottleneck (~1.1-1.4 ms a layer for 16 inputs at 1.4K keys). The C
kernel reads each block of K/V once for every query head and input that sees it and repeats torch's
arithmetic in torch's order: torch 2.14's ``cpu_flash_attention`` (kv blocks of 512, its ``fexp_u20``, the
scalar tail through glibc's double ``exp``, the fused running-sum update) around MKL's generic bf16 GEMV,
which MKL runs on this (AMD) CPU (``lynx_chain_sdpa.c`` writes the whole order out).

Nothing about the host is assumed at run time: :func:`matches_torch` compares the kernel with the per-input
SDPA loop (:func:`per_input_sdpa`, the same calls the backend makes) on random and adversarial inputs at
lengths around every block boundary and returns False, never raising, if any output bit differs (another
torch, another MKL code path on another CPU): the caller then keeps the per-input loop.

Lifecycle: :func:`build` compiles into the kernel cache (as ``lynx_cpu_fast``, keyed by source, flags and
CPU); :func:`library` loads it (``FastPathNotBuilt`` when absent); :func:`available` says whether this build
has the instructions (AVX-512 F/BW). :func:`chain_sdpa` is a pure function of its tensors; ``threads=``
(default ``$LYNX_CPU_THREADS`` or 1, as the codec's C paths) splits (KV head, block of inputs) work items
over the shared pool; the output does not depend on the split. Finite inputs only: NaN/inf are not checked.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from .lynx_cpu_fast import CachedLibrary, FastPathNotBuilt
from .lynx_cpu_threads import default_threads, run_pages

SOURCE = Path(__file__).with_name("lynx_chain_sdpa.c")
KV_SPLIT = 512  # torch's kv block for a one-row query (the C kernel's too)
MAX_HEAD_DIM = 256


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lynx_chain_sdpa_available.argtypes, lib.lynx_chain_sdpa_available.restype = [], ctypes.c_int
    lib.lynx_chain_sdpa.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr,
                                    i64, i64, i64, i64, i64, ctypes.c_float, i64, i64, i64]  # fmt: skip
    lib.lynx_chain_sdpa.restype = ctypes.c_int


LIBRARY = CachedLibrary("lynx_chain_sdpa", SOURCE, "the verify's chain attention kernel", _declare)
library_path, build, library = LIBRARY.path, LIBRARY.build, LIBRARY.load


def available() -> bool:
    """Whether the kernel is built and this CPU build has AVX-512 F/BW (else: keep the per-input SDPA loop)."""
    try:
        return bool(library().lynx_chain_sdpa_available())
    except (FastPathNotBuilt, OSError):
        return False


def default_scale(head_dim: int) -> float:
    """SDPA's scale when none is given: 1 / sqrt(D) in double, as torch computes it (then rounded to fp32)."""
    return 1.0 / math.sqrt(head_dim)


def _kv_view(t: Tensor, name: str, heads_first: bool) -> tuple[int, int, int, int]:
    """(tokens, kv heads, token stride, head stride) of a K or V tensor; D must be contiguous."""
    if t.dtype != torch.bfloat16 or t.dim() != 3 or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a 3-D bf16 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.stride(2) != 1:
        raise ValueError(f"{name}: the head dimension must be contiguous (stride 1), got strides {t.stride()}")
    if heads_first:
        return int(t.shape[1]), int(t.shape[0]), int(t.stride(1)), int(t.stride(0))
    return int(t.shape[0]), int(t.shape[1]), int(t.stride(0)), int(t.stride(1))


def chain_sdpa(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, scale: float | None = None, *,
               heads_first: bool = False, threads: int | None = None) -> Tensor:
    """Attention of ``q`` [n, H, D] (bf16, CPU) over ``k`` / ``v`` [S + n, Hk, D] (``heads_first``: the
    [Hk, S + n, D] view) where input i sees keys [0, S + i + 1), S = ``prefix_len``; query head h reads KV
    head h // (H / Hk). Returns [n, H, D] bf16: row i as :func:`per_input_sdpa` computes it on this host
    (where :func:`matches_torch` holds). ``scale`` None: 1 / sqrt(D)."""
    return _run(q, k, v, prefix_len, scale, heads_first, threads, with_lse=False)[0]


def chain_sdpa_with_lse(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, scale: float | None = None, *,
                        heads_first: bool = False, threads: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`chain_sdpa` and torch's logsumexp of every row ([n, H] fp32, as :func:`per_input_logsumexp`)."""
    out, lse = _run(q, k, v, prefix_len, scale, heads_first, threads, with_lse=True)
    assert lse is not None
    return out, lse


def _run(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, scale: float | None, heads_first: bool,
         threads: int | None, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.device.type != "cpu":
        raise ValueError(f"q: expected a 3-D [n, H, D] bf16 CPU tensor, got {q.dtype} {tuple(q.shape)} on {q.device}")
    n, heads, dim = (int(s) for s in q.shape)
    if n < 1:
        raise ValueError("q: the chain has no inputs (n = 0)")
    if dim % 16 or not 16 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {dim} is not supported (a multiple of 16 up to {MAX_HEAD_DIM})")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len: expected an integer >= 0, got {prefix_len!r}")
    tokens, kv_heads, k_st, k_sh = _kv_view(k, "k", heads_first)
    v_tokens, v_heads, v_st, v_sh = _kv_view(v, "v", heads_first)
    if (v_tokens, v_heads) != (tokens, kv_heads) or k.shape[-1] != dim or v.shape[-1] != dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match each other or q {tuple(q.shape)}")
    if tokens != prefix_len + n:
        raise ValueError(f"k/v hold {tokens} tokens, but a prefix of {prefix_len} and {n} inputs need "
                         f"{prefix_len + n}")  # fmt: skip
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = default_scale(dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    queries = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(n, heads, dim, dtype=torch.bfloat16)
    lse = torch.empty(n, heads, dtype=torch.float32) if with_lse else None
    lib = library()
    workers = threads or default_threads()
    blocks = max(1, min(n, -(-workers // kv_heads)))  # blocks of inputs per KV head: >= 1 item per thread
    q_block = -(-n // blocks)
    items = kv_heads * -(-n // q_block)
    args = (queries.data_ptr(), queries.stride(0), queries.stride(1), k.data_ptr(), k_st, k_sh, v.data_ptr(),
            v_st, v_sh, out.data_ptr(), out.stride(0), out.stride(1), None if lse is None else lse.data_ptr(), n,
            heads, kv_heads, dim, prefix_len, scale, q_block)  # fmt: skip

    def run(i0: int, i1: int) -> int:
        return int(lib.lynx_chain_sdpa(*args, i0, i1))

    for rc in run_pages(run, items, n * heads * tokens * dim, threads):
        if rc == 1:
            raise RuntimeError("the chain attention kernel was built without AVX-512 (check available() first)")
        if rc:
            raise RuntimeError(f"the chain attention kernel failed (code {rc}: 2 bad sizes, 3 out of memory)")
    return out, lse


def per_input_sdpa(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, scale: float | None = None, *,
                   enable_gqa: bool | None = None, out: Tensor | None = None) -> Tensor:
    """The reference, and the verify's path where the kernel does not serve
    (``integration/decode/chain_attention.chain_sdpa_decode``): what the CPU backend's decode attention
    computes for each input alone, one SDPA call per input on leading slices of the gathered rows (q [n, H, D];
    k / v [S + n, Hk, D] as gathered from the pool). ``enable_gqa`` None: whenever the head counts differ;
    ``out``: written in place (else a new tensor)."""
    n, heads = int(q.shape[0]), int(q.shape[1])
    gqa = heads != int(k.shape[1]) if enable_gqa is None else enable_gqa
    heads_first = q.movedim(0, 1)
    keys, values = k.movedim(0, 1), v.movedim(0, 1)
    out = torch.empty_like(q) if out is None else out
    for i in range(n):
        length = prefix_len + i + 1
        row = scaled_dot_product_attention(
            heads_first[:, i: i + 1, :].unsqueeze(0), keys[:, :length, :].unsqueeze(0),
            values[:, :length, :].unsqueeze(0), attn_mask=None, enable_gqa=gqa, scale=scale, is_causal=False,
        )  # fmt: skip
        out[i: i + 1] = row.squeeze(0).movedim(1, 0)
    return out


def per_input_logsumexp(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, scale: float | None = None) -> Tensor:
    """[n, H] fp32: the logsumexp of each input's row from the CPU flash-attention op SDPA runs here (its
    first result is :func:`per_input_sdpa`'s row; the second shows the exp sums that bf16 outputs hide)."""
    n, heads = int(q.shape[0]), int(q.shape[1])
    heads_first = q.movedim(0, 1)
    keys, values = k.movedim(0, 1), v.movedim(0, 1)
    lse = torch.empty(n, heads, dtype=torch.float32)
    for i in range(n):
        length = prefix_len + i + 1
        _, row = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            heads_first[:, i: i + 1, :].unsqueeze(0), keys[:, :length, :].unsqueeze(0),
            values[:, :length, :].unsqueeze(0), 0.0, False, attn_mask=None, scale=scale,
        )  # fmt: skip
        lse[i] = row.reshape(heads)
    return lse


#: input kinds of :func:`check_inputs`: each makes one step's order show in the outputs or the logsumexp
INPUT_KINDS = ("random", "wide", "flat", "cancel", "tail")
#: ``tail``'s score (with scale 1/8): the one bf16 number in [-104, 0] whose fp32 exp glibc's expf rounds
#: differently from the double exp torch's scalar tail calls (measured on this glibc by the tests)
TAIL_SCORE = -0.1005859375


def check_inputs(kind: str, n: int, prefix_len: int, heads: int = 9, kv_heads: int = 3, dim: int = 64,
                 seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(q [n, H, D], k, v [S + n, Hk, D]) bf16 on which the order of torch's steps reaches the result.
    ``random``: unit normals. ``wide``: entries scaled by 2^[-6, 6]: q.k sums of cancelling products, scores
    spread over hundreds (one key dominates, so the logsumexp shows its score's last bit; exp's zero,
    subnormal and vector/scalar ranges). ``flat``: tiny scores, every p near 1: the logsumexp shows the
    order of the exp sums. ``cancel``: q = 0 (every p exactly 1) and values in groups of 4 keys
    [+B, x, -B, y], B = +-2^[6, 12]: a different order of the p.v additions rounds x or y away. ``tail``:
    with scale 1/8, key 0 scores 0 and every other key :data:`TAIL_SCORE` exactly: the keys past the last
    16 of a block show which exp computed them (in the logsumexp of short rows)."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind: expected one of {INPUT_KINDS}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    tokens = prefix_len + n
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    if kind == "wide":
        q *= torch.exp2(torch.randint(-6, 7, q.shape, generator=g).float())
        k *= torch.exp2(torch.randint(-6, 7, k.shape, generator=g).float())
    elif kind == "flat":
        q *= 1e-3
    elif kind == "cancel":
        q.zero_()
        big = torch.exp2(torch.randint(6, 13, (-(-tokens // 4), kv_heads, dim), generator=g).float())
        big *= torch.randint(0, 2, big.shape, generator=g).float() * 2 - 1
        v[0::4] = big[: v[0::4].shape[0]]
        v[2::4] = -big[: v[2::4].shape[0]]
    elif kind == "tail":
        q.zero_()
        q[:, :, 0] = 1.0
        k[:, :, 0] = TAIL_SCORE * 8
        k[0, :, 0] = 0.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


#: (prefix_len, n) pairs of :func:`matches_torch`: inputs whose key counts end just before, on and after
#: the 16- and 32-key vector steps and the 512-key blocks (1, 15-17, 31-33, 511-513, 1023-1025; 21-27: where
#: the ``tail`` kind shows the scalar exp), checked
#: with every kind of input, GQA and not, outputs and logsumexp; then long prefixes (outputs, GQA, random
#: and cancelling values only: the per-input torch loop that the check runs is the slow part)
SELF_CHECK_CASES = ((0, 2), (14, 14), (30, 4), (495, 20), (1007, 20))
SELF_CHECK_LONG_CASES = ((1400, 16), (5590, 16))


def matches_torch(threads: int | None = None) -> bool:
    """Whether :func:`chain_sdpa` equals :func:`per_input_sdpa` (outputs) and :func:`per_input_logsumexp`
    bit for bit on :data:`SELF_CHECK_CASES` and :data:`SELF_CHECK_LONG_CASES` (D = 64, scale 1/8) under the
    current torch thread count. False, never raising, when anything differs or fails: the caller keeps the
    per-input loop."""
    try:
        if not available():
            return False
        checks = [(s, n, h, kind, True) for s, n in SELF_CHECK_CASES for h in ((9, 3), (4, 4)) for kind in INPUT_KINDS]
        checks += [(s, n, (9, 3), kind, False) for s, n in SELF_CHECK_LONG_CASES for kind in ("random", "cancel")]
        for seed, (prefix_len, n, (heads, kv_heads), kind, with_lse) in enumerate(checks):
            q, k, v = check_inputs(kind, n, prefix_len, heads, kv_heads, seed=seed)
            out, lse = chain_sdpa_with_lse(q, k, v, prefix_len, 0.125, threads=threads)
            if not torch.equal(out.view(torch.int16), per_input_sdpa(q, k, v, prefix_len, 0.125).view(torch.int16)):
                return False
            if with_lse and not torch.equal(lse.view(torch.int32),
                                            per_input_logsumexp(q, k, v, prefix_len, 0.125).view(torch.int32)):
                return False
        return True
    except Exception:
        return False
