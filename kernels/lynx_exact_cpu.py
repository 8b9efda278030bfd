"""CPU fast path of the ``lynx-exact`` stream: the bins and ranks in C (``lynx_exact_cpu.c``), zstd in Python.

Same bytes as the reference ``sglang_lynx.codec.lynx_exact.encode_exact`` and the same BF16 tensor as
its ``decode_exact`` (tested in ``tests/kernels/test_lynx_exact_cpu.py``): the C pass computes every
value's bin exactly as ``codec.exact_bins`` does (same float32 / float64 operations, no FMA
contraction), classifies and packs the ranks; the framing and the zstd frames are the reference's
(``lynx_exact.frame_stream`` / ``parse_stream``).

Lifecycle: :func:`build` compiles the C file into the kernel cache (as ``lynx_cpu_fast``, keyed by
source, flags and CPU); :func:`library` only loads it (``FastPathNotBuilt`` when absent). alpha 0 only,
as ``lynx-exact``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.base import EncodedKV
from sglang_lynx.codec.layout import LayoutParams, key_chunk, token_group
from sglang_lynx.codec.lynx_exact import RANK_CLASSES, ExactStreamError, check_exact_input, check_lynx
from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD, VALUE_GROUP_FIELD

from .lynx_cpu_fast import CFLAGS, FastPathNotBuilt, _cache_dir, _cpu_flags

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
_BITS = np.array([c.bits for c in RANK_CLASSES], dtype=np.int32)


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(EXACT_CFLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    return _cache_dir() / f"lynx_exact_cpu-{key}.so"


def build() -> Path:
    """Compile the library into the kernel cache unless it is there (idempotent)."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *EXACT_CFLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} with {compiler} failed:\n{done.stderr}")
        os.replace(out, target)
    return target


def library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            target = library_path()
            if not target.exists():
                raise FastPathNotBuilt(f"the lynx-exact CPU fast path is not built (no {target}); "
                                       "run `python -m sglang_lynx.kernels.build`")  # fmt: skip
            lib = ctypes.CDLL(str(target))
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            lib.lynx_exact_bins.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                            ptr, ptr, ptr]  # fmt: skip
            lib.lynx_exact_bins.restype = None
            lib.lynx_exact_classify.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr, ptr]
            lib.lynx_exact_classify.restype = i64
            lib.lynx_exact_pack.argtypes = [ptr, ptr, ptr, i64, ptr, ctypes.c_int, ptr, ptr, ptr, ptr]
            lib.lynx_exact_pack.restype = ctypes.c_int
            lib.lynx_exact_restore.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ptr,
                                               i64, ptr, ptr]  # fmt: skip
            lib.lynx_exact_restore.restype = ctypes.c_int
            _lib = lib
        return _lib


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def bins(enc: EncodedKV, params: LayoutParams) -> tuple[np.ndarray, np.ndarray, int]:
    """Flat (L, n) of every value (as ``exact_bins.bins``) and the count of sink values."""
    tokens, heads, dim = enc.num_tokens, enc.num_heads, enc.head_dim
    hd, count = heads * dim, tokens * heads * dim
    first, size = np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32)
    rows = [np.empty(hd, dtype=np.float32), np.empty(hd, dtype=np.float32),
            *(np.empty(hd, dtype=np.int32) for _ in range(3))]  # mn, rng, code, cap_lo, cap_hi
    anchor, residual = enc.anchor.contiguous().numpy(), enc.residual.contiguous().numpy()
    sink = min(params.sink_tokens, tokens)
    library().lynx_exact_bins(
        _ptr(anchor), _ptr(residual), tokens, hd, int(enc.kind == "k"), params.page_tokens,
        key_chunk(params, KEY_CHUNK_FIELD), token_group(params, dim, VALUE_GROUP_FIELD), sink, _ptr(first),
        _ptr(size), *(_ptr(r) for r in rows),
    )  # fmt: skip
    return first, size, sink * hd


def encode_exact(x: Tensor, enc: EncodedKV, params: LayoutParams | None = None, *,
                 level: int = lynx_exact.ZSTD_LEVEL) -> bytes:  # fmt: skip
    """``lynx_exact.encode_exact(x, enc, params, level=level)``, the same bytes (CPU tensors)."""
    params = params or LayoutParams()
    check_exact_input(x, enc, params, finite=False)  # finiteness: checked in C below
    if x.device.type != "cpu":
        raise ValueError(f"the lynx-exact CPU fast path takes CPU tensors, got {x.device}")
    first, size, skip = bins(enc, params)
    bits16 = x.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    count = bits16.size
    cls, rank = np.empty(count, dtype=np.uint8), np.empty(count, dtype=np.uint16)
    counts = np.zeros(len(RANK_CLASSES), dtype=np.int64)
    lib = library()
    escapes = lib.lynx_exact_classify(_ptr(bits16), _ptr(first), _ptr(size), count, skip, _ptr(_LO), _ptr(_HI),
                                      len(RANK_CLASSES), _ptr(cls), _ptr(rank), _ptr(counts))  # fmt: skip
    if escapes == -2:
        raise RuntimeError("lynx_exact_classify: more rank classes than the C path holds")
    if escapes < 0:
        check_exact_input(x, enc, params)  # the reference's error for a NaN or Inf
    planes: list[np.ndarray] = []
    for rank_class, n in zip(RANK_CLASSES, counts, strict=True):
        planes.append(np.zeros(lynx_exact.plane_bytes(rank_class.bits, int(n)), dtype=np.uint8))
        planes.append(np.zeros(int(n) if rank_class.bits == 16 else 0, dtype=np.uint8))
    plane_ptrs = np.array([_ptr(p) for p in planes], dtype=np.uint64)
    cursor = np.zeros(len(RANK_CLASSES), dtype=np.int64)
    escape_index, escape_bits = np.empty(escapes, dtype=np.int32), np.empty(escapes, dtype=np.uint16)
    if lib.lynx_exact_pack(_ptr(bits16), _ptr(cls), _ptr(rank), count, _ptr(_BITS), len(RANK_CLASSES),
                           _ptr(plane_ptrs), _ptr(cursor), _ptr(escape_index), _ptr(escape_bits)):  # fmt: skip
        raise RuntimeError("lynx_exact_pack: more rank classes than the C path holds")
    class_planes = [
        [planes[2 * k].tobytes(), *([planes[2 * k + 1].tobytes()] if c.bits == 16 else [])] if counts[k] else []
        for k, c in enumerate(RANK_CLASSES)
    ]
    return lynx_exact.frame_stream(escape_index.tobytes(), escape_bits.tobytes(), class_planes, level)


def decode_exact(enc: EncodedKV, exact: bytes | bytearray | memoryview, params: LayoutParams | None = None) -> Tensor:
    """``lynx_exact.decode_exact(enc, exact, params)``, the same BF16 tensor (CPU tensors)."""
    params = params or LayoutParams()
    check_lynx(enc, params)
    values = enc.num_tokens * enc.num_heads * enc.head_dim
    escape_index_b, escape_bits_b, class_planes = lynx_exact.parse_stream(bytes(exact), values)
    first, size, skip = bins(enc, params)
    count = first.size
    escape_index = np.frombuffer(escape_index_b, dtype=np.int32)
    escape_bits = np.frombuffer(escape_bits_b, dtype=np.uint16)
    if escape_index.size and (int(escape_index.min()) < skip or int(escape_index.max()) >= count
                              or bool((np.diff(escape_index) <= 0).any())):  # fmt: skip
        raise ExactStreamError("exact stream escapes a value outside the layer (or out of order)")
    arrays = []
    available = np.zeros(len(RANK_CLASSES), dtype=np.int64)
    for k, (rank_class, planes) in enumerate(zip(RANK_CLASSES, class_planes, strict=True)):
        low = np.frombuffer(planes[0], dtype=np.uint8) if planes else np.zeros(0, dtype=np.uint8)
        high = np.frombuffer(planes[1], dtype=np.uint8) if len(planes) > 1 else np.zeros(0, dtype=np.uint8)
        arrays += [np.ascontiguousarray(low), np.ascontiguousarray(high)]
        available[k] = low.size * (8 // rank_class.bits) if rank_class.bits < 8 else low.size
        if rank_class.bits == 16 and high.size != low.size:
            raise ExactStreamError(f"rank class {rank_class} has planes of {low.size} and {high.size} bytes")
    plane_ptrs = np.array([_ptr(a) if a.size else 0 for a in arrays], dtype=np.uint64)
    out = np.empty(count, dtype=np.uint16)
    header = enc.anchor[: 2 * skip].contiguous().numpy().view(np.uint16)
    out[:skip] = header
    cursor = np.zeros(len(RANK_CLASSES), dtype=np.int64)
    rc = library().lynx_exact_restore(
        _ptr(first), _ptr(size), count, skip, _ptr(_LO), _ptr(_HI), _ptr(_BITS), len(RANK_CLASSES), _ptr(plane_ptrs),
        _ptr(available), _ptr(np.ascontiguousarray(escape_index)), _ptr(np.ascontiguousarray(escape_bits)),
        escape_index.size, _ptr(out), _ptr(cursor),
    )  # fmt: skip
    if rc == 2:
        raise ExactStreamError("exact stream leaves a value of an empty bin unescaped")
    if rc:
        raise ExactStreamError("a rank lies outside its bin, or a rank class holds too few ranks")
    for k, (rank_class, planes) in enumerate(zip(RANK_CLASSES, class_planes, strict=True)):
        if len(planes[0] if planes else b"") != lynx_exact.plane_bytes(rank_class.bits, int(cursor[k])):
            raise ExactStreamError(f"rank class {rank_class} holds {len(planes[0]) if planes else 0} bytes for "
                                   f"{int(cursor[k])} values")  # fmt: skip
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).view(enc.num_tokens, enc.num_heads, enc.head_dim)
