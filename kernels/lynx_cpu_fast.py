"""CPU fast path of the ``lynx`` codec: a small C library (``lynx_cpu_fast.c``), byte-identical to the reference.

Why: the torch reference (``sglang_lynx.codec.lynx_format``) runs ~20 strided, broadcast tensor ops per
value and reaches well under 1 % of memory-copy bandwidth on this CPU (profile and numbers in
``benchmark/kernels/RESULTS.md``); one fused C pass per page reaches the issue's targets.

Lifecycle: the set-up (``scripts/setup.sh``, i.e. ``python -m sglang_lynx.kernels.build``) compiles the C
file with the system C compiler (``cc -O3 -march=native -mprefer-vector-width=512 -ffp-contract=off
-fno-trapping-math``, about 1.4 s here) into ``~/.cache/sglang-lynx/kernels/`` (or ``$LYNX_KERNEL_CACHE``),
keyed by a hash of the sources, the flags and this CPU's feature flags (``-march=native`` code must not
load on another CPU sharing the cache). At run time :func:`library` only loads it with ctypes: a server
never compiles on a request; without the built library it raises :class:`FastPathNotBuilt` and the
transport (``integration/transport/codec.prepare_fast_path``, at start-up) logs that it uses the torch
reference. ``encode`` / ``decode_into`` / ``decode`` have the
signatures and semantics of ``lynx_triton``'s (same ``EncodedKV``, same pool layout, same errors), plus
an optional ``threads=``.

The layer header (the first tokens in bf16) is written by C; the layer trailer (``recent_tokens``: the
last tokens' residual bytes repeated at the end of the anchor stream) is one ``memmove`` of the residual
tail after the C pass; an anchor-only decode hands C a pointer to the trailer, whose tokens decode with
their residual (the others ``a / 15``, as ``lynx_format.anchor_only_residual`` implies).

Finiteness is checked in C while the page is loaded, and the fp16-safe range after each page (the
reference's ``validate_input`` / range check then raise their errors naming layer and page); slot
indices are checked in C before anything is written.

Threads: one thread by default; ``threads=`` or ``$LYNX_CPU_THREADS`` split a layer's pages over more
(``lynx_cpu_threads``, which says why one is the default). The output does not depend on the thread count.

Exactness: alpha = 0 (the default) runs in C and is byte-identical (encode) and value-identical
(decode) to the reference -- tested in ``tests/kernels/test_lynx_cpu_fast.py``. alpha > 0
(companding) is not in C: it calls the torch reference, so it is identical but not fast.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from sglang_lynx.codec.base import ACCEPTED_DTYPES, EncodedKV, validate_input
from sglang_lynx.codec.layout import (
    Kind,
    LayoutParams,
    check_shape,
    header_bytes,
    key_chunk,
    page_block_bytes,
    scheme_layout,
    sink_count,
    stream_bytes,
    token_group,
    trailer_bytes,
    trailer_count,
)
from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD
from sglang_lynx.codec.quant_math import FP16_SAFE_ABS
from sglang_lynx.codec.registry import get_codec

from .lynx_cpu_threads import THREADS_ENV as THREADS_ENV  # re-exported: the thread-count settings
from .lynx_cpu_threads import default_threads as default_threads
from .lynx_cpu_threads import run_pages

SOURCE = Path(__file__).with_name("lynx_cpu_fast.c")
HEADERS = [Path(__file__).with_name("lynx_cpu_fast_rows.h")]  # included by SOURCE: part of the cache key
CFLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
    "-fPIC", "-shared", "-std=gnu11",
]  # fmt: skip
CODEC_NAMES = ("lynx", "lynx-int8", "lynx-int4")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DEFAULT_PARAMS = LayoutParams()

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("LYNX_KERNEL_CACHE", Path.home() / ".cache" / "sglang-lynx" / "kernels"))


def _cpu_flags() -> bytes:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``; elsewhere the platform's processor name)."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


class FastPathNotBuilt(RuntimeError):
    """The C library is not in the kernel cache for these sources, flags and CPU (run the build)."""


def library_path() -> Path:
    """Where the library for these sources, flags and this CPU lives in the kernel cache."""
    source = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    key = hashlib.sha256(source + " ".join(CFLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    return _cache_dir() / f"lynx_cpu_fast-{key}.so"


def build() -> Path:
    """Compile the library into the kernel cache unless it is there (the set-up's step; idempotent)."""
    return compile_into_cache(SOURCE, CFLAGS, library_path())


def compile_into_cache(source: Path, flags: list[str], target: Path) -> Path:
    """Compile ``source`` with ``flags`` into ``target`` in the kernel cache unless it is there (idempotent;
    the file appears whole, renamed from a temporary one). Every C library of ``kernels/`` is built so."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            done = subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
        except FileNotFoundError as exc:
            raise RuntimeError(f"no C compiler {compiler!r} found (install gcc, or set CC)") from exc
        if done.returncode != 0:
            raise RuntimeError(f"compiling {source} with {compiler} failed:\n{done.stderr}")
        os.replace(out, target)
    return target


def require_built(target: Path, what: str) -> Path:
    """``target``, or :class:`FastPathNotBuilt` (naming ``what``) when the library is not there."""
    if not target.exists():
        raise FastPathNotBuilt(f"{what} is not built for this CPU (no {target}); "
                               "run `python -m sglang_lynx.kernels.build` (scripts/setup.sh does)")
    return target


class CachedLibrary:
    """One C library of ``kernels/`` (other than this module's): compiled into the kernel cache under
    ``name-<key>.so`` (key: its source, ``flags`` and this CPU's flags), loaded once per process, its functions
    declared by ``declare``; ``what`` names it in the "not built" error."""

    def __init__(self, name: str, source: Path, what: str, declare: Callable[[ctypes.CDLL], None],
                 flags: list[str] = CFLAGS) -> None:  # noqa: B006 - never mutated
        self.name, self.source, self.what, self.declare, self.flags = name, source, what, declare, flags
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None

    def path(self) -> Path:
        key = hashlib.sha256(self.source.read_bytes() + " ".join(self.flags).encode() + _cpu_flags()).hexdigest()
        return _cache_dir() / f"{self.name}-{key[:16]}.so"

    def build(self) -> Path:
        """Compile the library into the kernel cache unless it is there (idempotent)."""
        return compile_into_cache(self.source, self.flags, self.path())

    def load(self) -> ctypes.CDLL:
        """The compiled library, loaded once per process; :class:`FastPathNotBuilt` when it was not built."""
        with self._lock:
            if self._lib is None:
                lib = ctypes.CDLL(str(require_built(self.path(), self.what)))
                self.declare(lib)
                self._lib = lib
            return self._lib


def library() -> ctypes.CDLL:
    """The compiled C library, loaded once per process; :class:`FastPathNotBuilt` when it was not built."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(str(require_built(library_path(), "the lynx CPU fast path")))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.lynx_encode.argtypes = [ptr, ctypes.c_int, *[i64] * 2, ctypes.c_int, *[i64] * 10, ptr, ptr, ptr,
                                    ctypes.c_float]  # fmt: skip
        lib.lynx_encode.restype = ctypes.c_int
        lib.lynx_decode.argtypes = [ptr, ptr, ptr, i64, ptr, ctypes.c_int, i64, ptr, *[i64] * 2, ctypes.c_int,
                                    *[i64] * 8]  # fmt: skip
        lib.lynx_decode.restype = ctypes.c_int
        lib.lynx_check_slots.argtypes = [ptr, i64, i64]
        lib.lynx_check_slots.restype = ctypes.c_int
        _lib = lib
        return lib


class _Layout(NamedTuple):
    a_len: int
    r_len: int
    hdr: int
    sink: int
    pages: int
    a_page: int
    r_page: int
    group: int
    trailer: int
    trailer_tokens: int


@functools.lru_cache(maxsize=256)
def _layout(tokens: int, heads: int, dim: int, kind: Kind, params: LayoutParams) -> _Layout:
    """Everything the C calls need about one layer's layout (cached: it is the same for every layer)."""
    a_len, r_len = stream_bytes("lynx", tokens, heads, dim, kind, params)
    a_page, r_page = page_block_bytes("lynx", params.page_tokens, heads, dim, kind, params)
    return _Layout(
        a_len, r_len, header_bytes("lynx", tokens, heads, dim, params), sink_count("lynx", tokens, params),
        -(-tokens // params.page_tokens), a_page, r_page, value_group(params, dim),
        trailer_bytes("lynx", tokens, heads, dim, params), trailer_count("lynx", tokens, params),
    )  # fmt: skip


def value_group(params: LayoutParams, head_dim: int) -> int:
    """Channels per value group, as the layout table sizes ``lynx``'s ``token`` groups (``value_group_size``)."""
    return token_group(params, head_dim, scheme_layout("lynx").token_group_field)


def _check_common(params: LayoutParams, alpha: float, head_dim: int) -> int:
    if not 0.0 <= float(alpha) <= 1e6:
        raise ValueError(f"alpha: {alpha} is out of range [0, 1e6]")
    group = value_group(params, head_dim)
    if group % 2:
        raise ValueError(f"the lynx CPU fast path needs an even value group size, got {group}")
    return group


def _check_cpu(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the lynx CPU fast path takes CPU tensors, got {t.device}")


def encode(
    x: Tensor,
    kind: Kind,
    *,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    layer: int | None = None,
    codec_name: str = "lynx",
    threads: int | None = None,
) -> EncodedKV:
    """``x[T, H, D]`` (bf16 / fp16 / fp32, CPU) -> the ``EncodedKV`` of ``get_codec(codec_name).encode(x, kind)``.

    ``threads``: threads for this layer (default :func:`default_threads`); the bytes do not depend on it."""
    if codec_name not in CODEC_NAMES:
        raise ValueError(f"the lynx CPU fast path encodes {', '.join(CODEC_NAMES)}, not {codec_name!r}")
    params = params or DEFAULT_PARAMS
    if not isinstance(x, Tensor) or x.dim() != 3 or x.dtype not in ACCEPTED_DTYPES or alpha > 0:
        validate_input(x, kind, layer, params.page_tokens)  # the reference's errors
    tokens, heads, dim = (int(s) for s in x.shape)
    check_shape(tokens, heads, dim, kind)
    _check_cpu(x)
    group = _check_common(params, alpha, dim)
    if alpha > 0:
        return get_codec(codec_name, alpha=alpha, **vars(params)).encode(x, kind, layer=layer)
    lay = _layout(tokens, heads, dim, kind, params)
    x = x.contiguous()
    anchor = torch.empty(lay.a_len, dtype=torch.uint8)
    residual = torch.empty(lay.r_len, dtype=torch.uint8)
    peak = torch.zeros(max(lay.pages, 1), dtype=torch.float32)
    if tokens:
        lib, hd, xp, pp = library(), heads * dim, x.data_ptr(), peak.data_ptr()
        ap, rp = anchor.data_ptr(), residual.data_ptr()
        chunk = key_chunk(params, KEY_CHUNK_FIELD)
        args = (xp, DTYPE_CODES[x.dtype], tokens, hd, int(kind == "k"), params.page_tokens, chunk, group,
                params.sink_tokens, lay.sink, lay.hdr, lay.a_page, lay.r_page)  # fmt: skip
        rcs = run_pages(lambda p0, p1: lib.lynx_encode(*args, p0, p1, ap, rp, pp, FP16_SAFE_ABS), lay.pages,
                         tokens * hd, threads)  # fmt: skip
        raise_encode_errors(rcs, x, kind, layer, params, peak, codec_name)
        if lay.trailer:  # the layer trailer: the last recent_tokens tokens' residual bytes, repeated in the anchor
            ctypes.memmove(ap + lay.a_len - lay.trailer, rp + lay.r_len - lay.trailer, lay.trailer)
    if codec_name == "lynx-int4":
        residual = residual[:0]
    return EncodedKV(anchor, residual, tokens, heads, dim, kind, codec_name)


def raise_encode_errors(rcs: list, x: Tensor, kind: Kind, layer: int | None, params: LayoutParams, peak: Tensor,
                        codec_name: str) -> None:
    """The reference's error for what the C pass reported (return codes ``rcs``, per-page ``peak``)."""
    if 1 in rcs:  # a NaN or Inf: the reference's error, naming layer and page
        validate_input(x, kind, layer, params.page_tokens)
    if -1 in rcs or 1 in rcs:
        raise RuntimeError(f"lynx CPU fast path: encode failed with codes {rcs} (-1: out of memory)")
    if 2 in rcs:
        bad = peak > FP16_SAFE_ABS
        page = int(bad.nonzero()[0, 0])
        where = f"layer {layer} {kind}" if layer is not None else kind
        raise ValueError(
            f"{codec_name} {where} page {page}: |value| up to {float(peak[page]):g} exceeds {FP16_SAFE_ABS:g}, "
            "the largest magnitude this codec's fp16 metadata can describe; use the bf16 codec for such tensors"
        )


def decode_into(
    anchor: Tensor,
    residual: Tensor | None,
    pool: Tensor,
    slot_indices: Tensor,
    *,
    kind: Kind,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    threads: int | None = None,
) -> Tensor:
    """Dequantize one layer's K or V into ``pool[slot_indices]`` (anchor-only when ``residual`` is None).

    ``threads``: threads for this layer (default :func:`default_threads`); the values do not depend on it."""
    params = params or DEFAULT_PARAMS
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    if pool.dim() != 3 or pool.dtype not in ACCEPTED_DTYPES:
        raise ValueError(f"pool must be [slots, heads, head_dim] bf16/fp16/fp32, got {pool.dtype} {tuple(pool.shape)}")
    if pool.stride(2) != 1 or pool.stride(1) != pool.shape[2]:
        raise ValueError(f"pool rows must be contiguous [heads, head_dim], got strides {pool.stride()}")
    if slot_indices.dtype != torch.int64 or slot_indices.dim() != 1:
        raise TypeError(f"slot_indices must be 1-D int64, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    for name, stream in (("anchor", anchor), ("residual", residual)):
        if stream is not None and (stream.dtype != torch.uint8 or stream.dim() != 1):
            raise TypeError(f"{name} must be a 1-D uint8 tensor, got {stream.dtype} {tuple(stream.shape)}")
    _check_cpu(anchor, pool, slot_indices, *([residual] if residual is not None else []))
    tokens, heads, dim = int(slot_indices.numel()), int(pool.shape[1]), int(pool.shape[2])
    group = _check_common(params, alpha, dim)
    lay = _layout(tokens, heads, dim, kind, params)
    if anchor.numel() != lay.a_len:
        raise ValueError(
            f"lynx {kind}: anchor has {anchor.numel()} bytes, expected {lay.a_len} for [{tokens}, {heads}, {dim}]"
        )
    if residual is not None and residual.numel() != lay.r_len:
        raise ValueError(f"lynx {kind}: residual has {residual.numel()} bytes, expected {lay.r_len}")
    slots = slot_indices.contiguous()
    lib = library()
    if tokens and lib.lynx_check_slots(slots.data_ptr(), tokens, pool.shape[0]):
        raise IndexError(f"slot_indices out of range [0, {pool.shape[0]})")
    if not tokens:
        return pool
    if alpha > 0:
        codec = get_codec("lynx", alpha=alpha, **vars(params))
        enc = EncodedKV(anchor, residual if residual is not None else anchor[:0], tokens, heads, dim, kind, "lynx")
        pool.index_copy_(0, slot_indices, codec.decode(enc, with_residual=residual is not None, dtype=pool.dtype))
        return pool
    anchor = anchor.contiguous()
    ap = anchor.data_ptr()
    res = residual.contiguous().data_ptr() if residual is not None else None
    trailer, first = (ap + lay.a_len - lay.trailer, tokens - lay.trailer_tokens) if lay.trailer else (None, tokens)
    args = (ap, res, trailer, first, pool.data_ptr(), DTYPE_CODES[pool.dtype], pool.stride(0), slots.data_ptr(),
            tokens, heads * dim, int(kind == "k"), params.page_tokens, key_chunk(params, KEY_CHUNK_FIELD), group,
            lay.sink, lay.hdr, lay.a_page)  # fmt: skip
    rcs = run_pages(lambda p0, p1: lib.lynx_decode(*args, p0, p1), lay.pages, tokens * heads * dim, threads)
    if any(rcs):
        raise RuntimeError(f"lynx CPU fast path: decode failed with codes {rcs} (-1: out of memory)")
    return pool


def decode(
    enc: EncodedKV,
    *,
    with_residual: bool,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
    threads: int | None = None,
) -> Tensor:
    """``codec.decode(enc, with_residual=..., dtype=..., out=...)`` through :func:`decode_into` (slots 0..T-1)."""
    if out is None:
        out = torch.empty(enc.num_tokens, enc.num_heads, enc.head_dim, dtype=dtype)
    slots = torch.arange(enc.num_tokens, dtype=torch.int64)
    residual = enc.residual if with_residual and enc.codec != "lynx-int4" else None
    return decode_into(enc.anchor, residual, out, slots, kind=enc.kind, params=params, alpha=alpha, threads=threads)
