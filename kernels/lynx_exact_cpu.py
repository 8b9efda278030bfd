"""CPU fast path of the ``lynx-exact`` stream: the bins and ranks in C (``lynx_exact_cpu.c``), zstd in Python.

Same bytes as the reference ``sglang_lynx.codec.lynx_exact.encode_exact`` and the same BF16 tensor as
its ``decode_exact`` (tested in ``tests/kernels/test_lynx_exact_cpu.py``, both builds): one C pass per
layer walks the lynx streams row by row, computes every value's bin exactly as ``codec.exact_bins`` does
(the same outcome of every float32 / float64 comparison, without its divisions), and either appends each
rank to its class's array and collects the escapes (encode; then ``lynx_exact_pack_bits`` per class) or
reads the ranks back in value order (decode, after ``lynx_exact_unpack_bits``); the framing and the zstd
frames are the reference's (``lynx_exact.frame_stream`` / ``parse_stream``). ``threads=`` runs the C pass on that many
workers (the same bytes and tensor; ``tests/kernels/test_lynx_exact_threads.py``).

Lifecycle: :func:`build` compiles the C file into the kernel cache (as ``lynx_cpu_fast``, keyed by
source, flags and CPU); :func:`library` only loads it (``FastPathNotBuilt`` when absent) and runs its
self-check. alpha 0 only, as ``lynx-exact``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.base import EncodedKV
from sglang_lynx.codec.layout import LayoutParams, key_chunk, token_group
from sglang_lynx.codec.lynx_exact import NOT_FINITE, RANK_CLASSES, ExactStreamError, check_exact_input, check_lynx
from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD, VALUE_GROUP_FIELD

from .lynx_cpu_fast import CFLAGS, _cache_dir, _cpu_flags, compile_into_cache, require_built

SOURCE = Path(__file__).with_name("lynx_exact_cpu.c")
#: lynx_cpu_fast's flags, plus what lets GCC if-convert (and so vectorise) the float clamps of the bin
#: search: every operand there is finite (ordinals are clamped to finite BF16, rng > 0 or 1, |u| stays
#: small) and no result depends on the sign of a zero (the clamps' bounds are nonzero constants or feed
#: an integer code; the targets have no constant-zero term). The tests compare with the reference.
EXACT_CFLAGS = [*CFLAGS, "-ffinite-math-only", "-fno-signed-zeros"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_LO = np.array([c.lo for c in RANK_CLASSES], dtype=np.int32)
_HI = np.array([c.hi for c in RANK_CLASSES], dtype=np.int32)
_LO_PTR, _HI_PTR = int(_LO.ctypes.data), int(_HI.ctypes.data)  # the arrays live as long as the module
LANES = 32  # entries the C pass may touch past a rank or escape array's last one (SLACK in lynx_exact_cpu.c)
LANES8 = 64  # entries the C pass may touch past a byte rank array's last one (SLACK8 there)
#: Rank classes whose ranks the decode reads as bytes (bins of at most 256 values, from the first class on:
#: Layer.byte_classes in lynx_exact_cpu.c); the others as 16-bit ranks.
BYTE_CLASSES = next((k for k, c in enumerate(RANK_CLASSES) if c.hi > 256), len(RANK_CLASSES))
_CLASSES = len(RANK_CLASSES)
_PER_BYTE = [8 // c.bits if c.bits < 8 else 1 for c in RANK_CLASSES]  # ranks per byte of a class's (low) plane
_WIDTH = [1 if k < BYTE_CLASSES else 2 for k in range(_CLASSES)]  # bytes per rank in the decode's arrays
_WIDE = [k for k, c in enumerate(RANK_CLASSES) if c.bits == 16]  # classes of two planes
_BITS = (ctypes.c_int32 * _CLASSES)(*(c.bits for c in RANK_CLASSES))
_buffers = threading.local()  # per thread: scratch reused across calls (grown on demand, never shrunk)
#: :func:`decode_exact` writes into a caller's tensor (``out=``): ``exact_request`` decodes a piece into its rows
DECODES_INTO = True


def _buffer(name: str, nbytes: int) -> int:
    """The address of this thread's scratch ``name`` of at least ``nbytes`` bytes (valid until its next call
    with a larger size on this thread)."""
    buf = getattr(_buffers, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 12), dtype=np.uint8)
        setattr(_buffers, name, buf)
    return int(buf.ctypes.data)
MAX_THREADS = 8  # workers the C pass runs at most (MAX_THREADS there)


def _threads(threads: int) -> int:
    if not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be an int in 1..{MAX_THREADS}, got {threads!r}")
    return threads


def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    flags = " ".join([*EXACT_CFLAGS, *extra_flags]).encode()
    key = hashlib.sha256(SOURCE.read_bytes() + flags + _cpu_flags()).hexdigest()[:16]
    return _cache_dir() / f"lynx_exact_cpu-{key}.so"


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the library into the kernel cache unless it is there (idempotent). ``extra_flags``: a
    variant (the tests build ``-DLYNX_EXACT_SCALAR``, the path without AVX-512)."""
    return compile_into_cache(SOURCE, [*EXACT_CFLAGS, *extra_flags], library_path(extra_flags))


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions declared, after its self-check (the tables the bins rest on)."""
    lib = _declare(ctypes.CDLL(str(path)))
    if not lib.lynx_exact_self_check():
        raise RuntimeError(f"{path}: the lynx-exact tables failed their self-check on this CPU")
    return lib


def library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            _lib = load(require_built(library_path(), "the lynx-exact CPU fast path"))
        return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    walk: list[Any] = [ptr, ptr, i64, i64, i32, i64, i64, i64, i64]  # anchor, residual, T, hd, is_key, P, C, G, sink
    lib.lynx_exact_bins.argtypes = [*walk, ptr, ptr, ptr, ptr]
    lib.lynx_exact_bins.restype = ctypes.c_int
    lib.lynx_exact_encode.argtypes = [*walk, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, i32]  # ptr: int or array
    lib.lynx_exact_encode.restype = i64
    lib.lynx_exact_decode.argtypes = [*walk, ptr, ptr, i32, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32, ptr]
    lib.lynx_exact_decode_chunk_rows.argtypes = [i64, i64]
    lib.lynx_exact_decode_chunk_rows.restype = i64
    lib.lynx_exact_decode.restype = i32
    lib.lynx_exact_pack_bits.argtypes = [ptr, i64, i32, ptr, ptr]
    lib.lynx_exact_pack_bits.restype = None
    lib.lynx_exact_unpack_bits.argtypes = [ptr, ptr, i64, i32, ptr]
    lib.lynx_exact_unpack_bits.restype = None
    lib.lynx_exact_unpack_bits8.argtypes = [ptr, i64, i32, ptr]
    lib.lynx_exact_unpack_bits8.restype = None
    lib.lynx_exact_pack_bits8.argtypes = [ptr, i64, i32, ptr]
    lib.lynx_exact_pack_bits8.restype = None
    lib.lynx_exact_unpack_classes.argtypes = [i32, i32, ptr, ptr, ptr, ptr, i64, ptr, ptr]
    lib.lynx_exact_unpack_classes.restype = None
    lib.lynx_exact_lower_pairs.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.lynx_exact_lower_pairs.restype = None
    lib.lynx_exact_fallbacks.argtypes = []
    lib.lynx_exact_fallbacks.restype = i64
    for name in ("lynx_exact_vector", "lynx_exact_self_check"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = i32
    return lib


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)  # ~1.6 us each: the glue takes few (one buffer per kind, bytes passed as they are)


@functools.lru_cache(maxsize=256)
def _layout(tokens: int, heads: int, dim: int, kind: str, params: LayoutParams) -> tuple[int, ...]:
    """The C walk's shape, layout and sink arguments (after anchor and residual)."""
    return (tokens, heads * dim, int(kind == "k"), params.page_tokens, key_chunk(params, KEY_CHUNK_FIELD),
            token_group(params, dim, VALUE_GROUP_FIELD), min(params.sink_tokens, tokens))  # fmt: skip


def _walk(enc: EncodedKV, params: LayoutParams) -> tuple[list[int], Tensor, Tensor]:
    """The C walk's arguments and the tensors they point into (the caller holds them until the call returns)."""
    anchor, residual = enc.anchor.contiguous(), enc.residual.contiguous()  # uint8 (check_lynx); as they are
    layout = _layout(enc.num_tokens, enc.num_heads, enc.head_dim, enc.kind, params)
    return [anchor.data_ptr(), residual.data_ptr(), *layout], anchor, residual


def _scratch(hd: int, threads: int) -> tuple[int, int]:
    """This thread's C scratch for ``threads`` workers: 3 hd floats and 5 hd int32 each."""
    return _buffer("f_scratch", 12 * hd * threads), _buffer("i_scratch", 20 * hd * threads)


def lower_pairs(code: np.ndarray, mn: np.ndarray, rng: np.ndarray, lib: ctypes.CDLL | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the tests: ``lower(code)`` of each (code, mn, rng) by the fast path (and where it decided) and by the
    window search it falls back to (``lynx_exact_cpu.c``, ``fast_lower``)."""
    code = np.ascontiguousarray(code, dtype=np.int32)
    mn, rng = np.ascontiguousarray(mn, dtype=np.float32), np.ascontiguousarray(rng, dtype=np.float32)
    fast, ok, search = (np.empty(code.size, dtype=np.int32) for _ in range(3))
    (lib or library()).lynx_exact_lower_pairs(code.size, _ptr(code), _ptr(mn), _ptr(rng), _ptr(fast), _ptr(ok),
                                              _ptr(search))  # fmt: skip
    return fast, ok.astype(bool), search


def fallbacks(lib: ctypes.CDLL | None = None) -> int:
    """Bin bounds the fast path left to the window search, summed over every call of this process."""
    return int((lib or library()).lynx_exact_fallbacks())


def bins(enc: EncodedKV, params: LayoutParams, lib: ctypes.CDLL | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Flat (L, n) of every value (as ``exact_bins.bins``) and the count of sink values."""
    count = enc.num_tokens * enc.num_heads * enc.head_dim
    first, size = np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32)
    walk, _anchor, _residual = _walk(enc, params)
    if (lib or library()).lynx_exact_bins(*walk, _ptr(first), _ptr(size), *_scratch(walk[3], 1)) == 4:
        raise ExactStreamError(NOT_FINITE)
    return first, size, min(params.sink_tokens, enc.num_tokens) * enc.num_heads * enc.head_dim


def encode_exact(x: Tensor, enc: EncodedKV, params: LayoutParams | None = None, *,
                 level: int = lynx_exact.ZSTD_LEVEL, lib: ctypes.CDLL | None = None,
                 blocks: bool = False, threads: int = 1) -> bytes:  # fmt: skip
    """``lynx_exact.encode_exact(x, enc, params, level=level, blocks=blocks)``, the same bytes (CPU tensors;
    the sizes are checked before C reads a byte). ``threads``: C workers over runs of rows, and threads that
    compress the frames (the same bytes)."""
    params = params or LayoutParams()
    threads = _threads(threads)
    check_exact_input(x, enc, params, finite=False, blocks=blocks)  # finiteness: checked in C below
    if x.device.type != "cpu":
        raise ValueError(f"the lynx-exact CPU fast path takes CPU tensors, got {x.device}")
    lib = lib or library()
    bits16 = x.contiguous()
    count = bits16.numel()
    capacity = count + LANES8 * threads + 1 & ~1  # entries per class (even: 16-bit classes stay aligned)
    ranks = np.empty(sum(_WIDTH) * capacity, dtype=np.uint8)  # bytes or 16-bit ranks; untouched pages cost nothing
    offsets = np.cumsum([0, *_WIDTH[:-1]]) * capacity
    rank_ptrs = (ctypes.c_uint64 * _CLASSES)(*(_ptr(ranks) + int(o) for o in offsets))
    class_counts = (ctypes.c_int64 * _CLASSES)()
    escape_index, escape_bits = np.empty(capacity, dtype=np.int32), np.empty(capacity, dtype=np.uint16)
    walk, _anchor, _residual = _walk(enc, params)
    escapes = lib.lynx_exact_encode(*walk, bits16.data_ptr(), _LO_PTR, _HI_PTR, len(RANK_CLASSES), rank_ptrs,
                                    class_counts, _ptr(escape_index), _ptr(escape_bits), *_scratch(walk[3], threads),
                                    threads)  # fmt: skip
    if escapes == -2:
        raise RuntimeError("lynx_exact_encode: a rank class table the C path cannot hold")
    if escapes == -3:
        raise ExactStreamError(NOT_FINITE)
    if escapes < 0:
        check_exact_input(x, enc, params, blocks=blocks)  # the reference's error for a NaN or Inf
    counts = list(class_counts)
    sizes = [lynx_exact.plane_bytes(c.bits, n) for c, n in zip(RANK_CLASSES, counts, strict=True)]
    highs = [n if c.bits == 16 else 0 for c, n in zip(RANK_CLASSES, counts, strict=True)]
    packed = np.empty(sum(sizes) + sum(highs), dtype=np.uint8)  # every plane, then the high planes
    base, at, high_at = _ptr(packed), 0, sum(sizes)
    class_planes: list[list[memoryview]] = []
    for k, (rank_class, n) in enumerate(zip(RANK_CLASSES, counts, strict=True)):
        if n and k < BYTE_CLASSES:
            lib.lynx_exact_pack_bits8(rank_ptrs[k], n, rank_class.bits, base + at)
        elif n:
            lib.lynx_exact_pack_bits(rank_ptrs[k], n, rank_class.bits, base + at, base + high_at)
        class_planes.append([] if not n else [packed[at : at + sizes[k]].data,
                                              *([packed[high_at : high_at + n].data] if highs[k] else [])])
        at, high_at = at + sizes[k], high_at + highs[k]
    return lynx_exact.frame_stream(escape_index[:escapes].tobytes(), escape_bits[:escapes].tobytes(), class_planes,
                                   level, workers=threads)  # fmt: skip


def decode_exact(enc: EncodedKV, exact: bytes | bytearray | memoryview, params: LayoutParams | None = None, *,
                 lib: ctypes.CDLL | None = None, blocks: bool = False, threads: int = 1,
                 out: Tensor | None = None) -> Tensor:  # fmt: skip
    """``lynx_exact.decode_exact(enc, exact, params, blocks=blocks)``, the same BF16 tensor (CPU tensors).
    ``threads``: C workers over chunks of rows, and threads that decompress the frames (the same tensor).
    ``out``: a contiguous CPU BF16 tensor of the layer's shape to write it into (returned; on an error its
    contents are undefined), else a new one."""
    params = params or LayoutParams()
    threads = _threads(threads)
    check_lynx(enc, params, blocks=blocks)
    shape = (enc.num_tokens, enc.num_heads, enc.head_dim)
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != shape or out.device.type != "cpu"
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"out must be a contiguous CPU bfloat16 tensor of shape {shape}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    lib = lib or library()
    hd = enc.num_heads * enc.head_dim
    count = enc.num_tokens * hd
    skip = min(params.sink_tokens, enc.num_tokens) * hd
    escape_index_b, escape_bits_b, class_planes = lynx_exact.parse_stream(bytes(exact), count, workers=threads)
    escapes = len(escape_index_b) // 4
    if escapes:
        escape_index = np.frombuffer(escape_index_b, dtype=np.int32)
        if (int(escape_index.min()) < skip or int(escape_index.max()) >= count
                or bool((np.diff(escape_index) <= 0).any())):  # fmt: skip
            raise ExactStreamError("exact stream escapes a value outside the layer (or out of order)")
    lows = [planes[0] if planes else b"" for planes in class_planes]
    for k in _WIDE:
        if len(class_planes[k]) > 1 and len(class_planes[k][1]) != len(lows[k]):
            raise ExactStreamError(f"rank class {RANK_CLASSES[k]} has planes of {len(lows[k])} and "
                                   f"{len(class_planes[k][1])} bytes")  # fmt: skip
    available = (ctypes.c_int64 * _CLASSES)(*[len(low) * per for low, per in zip(lows, _PER_BYTE, strict=True)])
    slack = LANES8 + hd  # each class's ranks, then LANES8 + hd readable entries (C checks by row)
    rank_ptrs = (ctypes.c_uint64 * _CLASSES)()
    capacity = sum(w * (n + slack) for w, n in zip(_WIDTH, available, strict=True)) + _CLASSES
    highs = [planes[-1] if planes else b"" for planes in class_planes]
    lib.lynx_exact_unpack_classes(_CLASSES, BYTE_CLASSES, _BITS, (ctypes.c_char_p * _CLASSES)(*lows),
                                  (ctypes.c_char_p * _CLASSES)(*highs), available, slack, _buffer("ranks", capacity),
                                  rank_ptrs)  # fmt: skip
    out = torch.empty(shape, dtype=torch.bfloat16) if out is None else out  # the sink: copied in C
    cursor = (ctypes.c_int64 * _CLASSES)()
    walk, anchor, residual = _walk(enc, params)
    bins_scratch = None
    if threads > 1:
        bins_scratch = _buffer("bins", 8 * threads * lib.lynx_exact_decode_chunk_rows(hd, walk[6]) * hd)
    rc = lib.lynx_exact_decode(*walk, _LO_PTR, _HI_PTR, _CLASSES, rank_ptrs, available, escape_index_b,
                               escape_bits_b, escapes, out.data_ptr(), cursor, *_scratch(hd, threads), threads,
                               bins_scratch)  # fmt: skip
    if rc == 3:
        raise RuntimeError("lynx_exact_decode: a rank class table the C path cannot hold")
    if rc == 4:
        raise ExactStreamError(NOT_FINITE)
    if rc == 2:
        raise ExactStreamError("exact stream leaves a value of an empty bin unescaped")
    if rc:
        raise ExactStreamError("a rank lies outside its bin, or a rank class holds too few ranks")
    for k, (rank_class, low) in enumerate(zip(RANK_CLASSES, lows, strict=True)):
        if len(low) != lynx_exact.plane_bytes(rank_class.bits, cursor[k]):
            raise ExactStreamError(f"rank class {rank_class} holds {len(low)} bytes for {cursor[k]} values")
    return out
