"""CPU fast path of the ``lynx`` codec: a small C library (``lynx_cpu_fast.c``), byte-identical to the reference.

Why: the torch reference (``sglang_lynx.codec.lynx_format``) runs ~20 strided, broadcast tensor ops per
value and reaches well under 1 % of memory-copy bandwidth on this CPU (profile and numbers in
``benchmark/kernels/RESULTS.md``); one fused C pass per page reaches the issue's targets.

Lifecycle: on first use the C file is compiled with the system C compiler (``cc -O3 -march=native
-ffp-contract=off -fno-trapping-math``, about a second) into ``~/.cache/sglang-lynx/kernels/`` (or
``$LYNX_KERNEL_CACHE``), keyed by a hash of the source and flags, and loaded with ctypes; later
processes reuse it. ``encode`` / ``decode_into`` / ``decode`` have the signatures and semantics of
``lynx_triton``'s (same ``EncodedKV``, same pool layout, same errors).

The layer trailer (``recent_tokens``: the last tokens' residual bytes repeated at the end of the anchor
stream) is plain byte copying done here in Python: encode copies the tail of the residual the C pass
wrote; an anchor-only decode hands C the residual stream the trailer implies
(``lynx_format.anchor_only_residual``: nibble 7 elsewhere, which decodes bit-identically to anchor-only).

Finiteness is checked in C while the page is loaded (NaN / Inf: the reference's ``validate_input``
then raises its error naming layer and page).

Exactness: alpha = 0 (the default) runs in C and is byte-identical (encode) and value-identical
(decode) to the reference -- tested in ``tests/kernels/test_lynx_cpu_fast.py``. alpha > 0
(companding) is not in C: it calls the torch reference, so it is identical but not fast.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from sglang_lynx.codec.base import ACCEPTED_DTYPES, EncodedKV, validate_input
from sglang_lynx.codec.layout import (
    Kind,
    LayoutParams,
    check_shape,
    header_bytes,
    page_block_bytes,
    scheme_layout,
    sink_count,
    stream_bytes,
    token_group,
    trailer_bytes,
)
from sglang_lynx.codec.lynx_format import anchor_only_residual
from sglang_lynx.codec.quant_math import FP16_SAFE_ABS
from sglang_lynx.codec.registry import get_codec

SOURCE = Path(__file__).with_name("lynx_cpu_fast.c")
CFLAGS = [
    "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
    "-fPIC", "-shared", "-std=gnu11",
]  # fmt: skip
CODEC_NAMES = ("lynx", "lynx-int8", "lynx-int4")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("LYNX_KERNEL_CACHE", Path.home() / ".cache" / "sglang-lynx" / "kernels"))


def library() -> ctypes.CDLL:
    """The compiled C library (compiled once per source / flags, then cached on disk)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        source = SOURCE.read_bytes()
        key = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
        target = _cache_dir() / f"lynx_cpu_fast-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            compiler = os.environ.get("CC", "cc")
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                done = subprocess.run(
                    [compiler, *CFLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True, timeout=120
                )
                if done.returncode != 0:
                    raise RuntimeError(f"compiling {SOURCE} with {compiler} failed:\n{done.stderr}")
                os.replace(out, target)
        lib = ctypes.CDLL(str(target))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.lynx_encode.argtypes = [ptr, ctypes.c_int, *[i64] * 2, ctypes.c_int, *[i64] * 7, ptr, ptr, ptr]
        lib.lynx_encode.restype = ctypes.c_int
        lib.lynx_decode.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ctypes.c_int, *[i64] * 7]
        lib.lynx_decode.restype = None
        _lib = lib
        return lib


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
) -> EncodedKV:
    """``x[T, H, D]`` (bf16 / fp16 / fp32, CPU) -> the ``EncodedKV`` of ``get_codec(codec_name).encode(x, kind)``."""
    if codec_name not in CODEC_NAMES:
        raise ValueError(f"the lynx CPU fast path encodes {', '.join(CODEC_NAMES)}, not {codec_name!r}")
    params = params or LayoutParams()
    if not isinstance(x, Tensor) or x.dim() != 3 or x.dtype not in ACCEPTED_DTYPES or alpha > 0:
        validate_input(x, kind, layer, params.page_tokens)  # the reference's errors
    check_shape(int(x.shape[0]), int(x.shape[1]), int(x.shape[2]), kind)
    _check_cpu(x)
    tokens, heads, dim = (int(s) for s in x.shape)
    group = _check_common(params, alpha, dim)
    if alpha > 0:
        return get_codec(codec_name, alpha=alpha, **vars(params)).encode(x, kind, layer=layer)
    hd = heads * dim
    x = x.contiguous()
    a_len, r_len = stream_bytes("lynx", tokens, heads, dim, kind, params)
    anchor = torch.empty(a_len, dtype=torch.uint8)
    residual = torch.empty(r_len, dtype=torch.uint8)
    hdr = header_bytes("lynx", tokens, heads, dim, params)
    sink = sink_count("lynx", tokens, params)
    if sink:
        anchor[:hdr] = x[:sink].to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)
    pages = -(-tokens // params.page_tokens)
    peak = torch.zeros(max(pages, 1), dtype=torch.float32)
    if tokens:
        a_page, r_page = page_block_bytes("lynx", params.page_tokens, heads, dim, kind, params)
        rc = library().lynx_encode(
            x.data_ptr(), DTYPE_CODES[x.dtype], tokens, hd, int(kind == "k"), params.page_tokens,
            params.chunk_tokens, group, params.sink_tokens, hdr, a_page, r_page,
            anchor.data_ptr(), residual.data_ptr(), peak.data_ptr(),
        )  # fmt: skip
        if rc == 1:  # a NaN or Inf: the reference's error, naming layer and page
            validate_input(x, kind, layer, params.page_tokens)
        if rc != 0:
            raise RuntimeError(f"lynx CPU fast path: encode failed with code {rc} (-1: out of memory)")
    bad = peak > FP16_SAFE_ABS
    if bool(bad.any()):
        page = int(bad.nonzero()[0, 0])
        where = f"layer {layer} {kind}" if layer is not None else kind
        raise ValueError(
            f"{codec_name} {where} page {page}: |value| up to {float(peak[page]):g} exceeds {FP16_SAFE_ABS:g}, "
            "the largest magnitude this codec's fp16 metadata can describe; use the bf16 codec for such tensors"
        )
    trailer = trailer_bytes("lynx", tokens, heads, dim, params)
    if trailer:  # the layer trailer: the last recent_tokens tokens' residual bytes, repeated in the anchor
        anchor[a_len - trailer :] = residual[r_len - trailer :]
    if codec_name == "lynx-int4":
        residual = residual[:0]
    return EncodedKV(anchor, residual, tokens, heads, dim, kind, codec_name)


def decode_into(
    anchor: Tensor,
    residual: Tensor | None,
    pool: Tensor,
    slot_indices: Tensor,
    *,
    kind: Kind,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
) -> Tensor:
    """Dequantize one layer's K or V into ``pool[slot_indices]`` (anchor-only when ``residual`` is None)."""
    params = params or LayoutParams()
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
    want_anchor, want_residual = stream_bytes("lynx", tokens, heads, dim, kind, params)
    if anchor.numel() != want_anchor:
        raise ValueError(
            f"lynx {kind}: anchor has {anchor.numel()} bytes, expected {want_anchor} for [{tokens}, {heads}, {dim}]"
        )
    if residual is not None and residual.numel() != want_residual:
        raise ValueError(f"lynx {kind}: residual has {residual.numel()} bytes, expected {want_residual}")
    if tokens and (int(slot_indices.min()) < 0 or int(slot_indices.max()) >= pool.shape[0]):
        raise IndexError(f"slot_indices out of range [0, {pool.shape[0]})")
    if not tokens:
        return pool
    if alpha > 0:
        codec = get_codec("lynx", alpha=alpha, **vars(params))
        enc = EncodedKV(anchor, residual if residual is not None else anchor[:0], tokens, heads, dim, kind, "lynx")
        pool.index_copy_(0, slot_indices, codec.decode(enc, with_residual=residual is not None, dtype=pool.dtype))
        return pool
    anchor, slots = anchor.contiguous(), slot_indices.contiguous()
    # anchor-only with a layer trailer: the residual the trailer implies (nibble 7 elsewhere, exact anchor values)
    res = residual.contiguous() if residual is not None else anchor_only_residual(anchor, tokens, heads, dim, params)
    hdr = header_bytes("lynx", tokens, heads, dim, params)
    a_page, r_page = page_block_bytes("lynx", params.page_tokens, heads, dim, kind, params)
    library().lynx_decode(
        anchor.data_ptr(), res.data_ptr() if res is not None else None, pool.data_ptr(), DTYPE_CODES[pool.dtype],
        pool.stride(0), slots.data_ptr(), tokens, heads * dim, int(kind == "k"), params.page_tokens,
        params.chunk_tokens, group, sink_count("lynx", tokens, params), hdr, a_page, r_page,
    )  # fmt: skip
    return pool


def decode(
    enc: EncodedKV,
    *,
    with_residual: bool,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """``codec.decode(enc, with_residual=..., dtype=..., out=...)`` through :func:`decode_into` (slots 0..T-1)."""
    if out is None:
        out = torch.empty(enc.num_tokens, enc.num_heads, enc.head_dim, dtype=dtype)
    slots = torch.arange(enc.num_tokens, dtype=torch.int64)
    residual = enc.residual if with_residual and enc.codec != "lynx-int4" else None
    return decode_into(enc.anchor, residual, out, slots, kind=enc.kind, params=params, alpha=alpha)
