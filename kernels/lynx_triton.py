"""Triton encode / decode-into-pool of the ``lynx`` codec, byte-compatible with the torch reference.

Reference: ``sglang_lynx.codec.lynx_format`` (the exact code and byte layout) behind
``get_codec("lynx" | "lynx-int8" | "lynx-int4")``. The kernels are in ``lynx_triton_kernels``.

Lifecycle: ``encode(x, kind)`` is called per (layer, kind) on the prefill side and returns an
``EncodedKV`` whose two streams are byte-identical to ``codec.encode(x, kind)`` (alpha = 0; with
alpha > 0 a code may differ by one step at a rounding boundary, see the kernels' docstring).
``decode_into(anchor, residual, pool, slot_indices, kind=...)`` is called on the decode side when the
anchor lands (``residual=None``: anchor-only) and again when the residual lands (full reconstruction,
overwriting the same slots in place); it writes ``pool[slot_indices[i]] = token i`` in the pool dtype,
as ``pool.index_copy_(0, slot_indices, codec.decode(enc, dtype=pool.dtype))`` does.

What runs where:

* Triton (one launch per call): encode -- page/chunk statistics with the page-0 key sink rule, fp16
  directed rounding of min / range, normalise, compand (alpha > 0), anchor and residual codes, nibble
  packing, metadata and codes written at their layout offsets, a per-program peak |min|, |max| for the
  fp16 range check. Decode -- metadata and nibble loads, anchor-only or full reconstruction, inverse
  companding, denormalisation, sink tokens taken from the bf16 header, cast to the pool dtype and
  scatter into the pool slots.
* Torch around it: input validation (shape, dtype, NaN / Inf with layer and page, via the codec's
  ``validate_input``), the layer header (``x[:sink].to(bf16)``, a copy of ``sink_tokens`` tokens), the
  layer trailer (``recent_tokens``: encode copies the tail of the residual into the anchor's end; an
  anchor-only decode runs the full-decode kernel on ``lynx_format.anchor_only_residual``, nibble 7 but
  for the trailer -- bit-identical to anchor-only, the kernels dividing with ``tl.math.div_rn``),
  stream allocation and sizes (``layout.stream_bytes``), and the fp16-range error raised from the
  kernel's peaks.

Limits: value groups ``G = min(value_group_size, head_dim)`` (the ``lynx`` layout row's
``token_group_field``; ``group_size`` sizes only the int8/int4 baselines) must be even (the default
32 is) and, as in the reference, divide head_dim for keys and values alike; the pool must
be ``[slots, heads, head_dim]`` with contiguous ``(heads, head_dim)``; all tensors on one device. On a
CPU the kernels run only under ``TRITON_INTERPRET=1`` (set before triton is imported): tests only --
the CPU fast path is ``lynx_cpu_fast``.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from sglang_lynx.codec.base import ACCEPTED_DTYPES, EncodedKV, validate_input
from sglang_lynx.codec.layout import (
    Kind,
    LayoutParams,
    header_bytes,
    key_chunk,
    page_block_bytes,
    scheme_layout,
    sink_count,
    stream_bytes,
    token_group,
    trailer_bytes,
)
from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD, anchor_only_residual
from sglang_lynx.codec.page_reuse_encode import check_page_range
from sglang_lynx.codec.quant_math import FP16_SAFE_ABS

from . import lynx_triton_kernels as K

CODEC_NAMES = ("lynx", "lynx-int8", "lynx-int4")
MAX_ALPHA = 1e6
PAIRS_PER_PROGRAM = 64  # key kernels: channel pairs per program (the tile width; see the kernels' docstring)


def interpreted() -> bool:
    """True when the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(K.encode_keys_kernel).__name__ == "InterpretedFunction"


def _check_device(*tensors: Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the lynx Triton kernels need a GPU, or TRITON_INTERPRET=1 set before triton is imported "
            "(tests only); on a CPU use sglang_lynx.kernels.lynx_cpu_fast"
        )


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= MAX_ALPHA:
        raise ValueError(f"alpha: {alpha} is out of range [0, {MAX_ALPHA:g}]")
    return alpha


def _value_group(params: LayoutParams, head_dim: int) -> int:
    """Channels per value group: the layout row's ``token_group_field`` (``value_group_size`` for lynx)."""
    group = token_group(params, head_dim, scheme_layout("lynx").token_group_field)
    if group % 2:
        raise ValueError(f"the Triton lynx kernels need an even value group size, got {group}")
    return group


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _pair_blocks(hd: int, pairs_per_program: int) -> tuple[int, int]:
    """(BLOCK_HALF, programs along the channels) for the key kernels: ``hd / 2`` code bytes per token,
    at most ``pairs_per_program`` (a power of two) per program."""
    if pairs_per_program < 1 or pairs_per_program & (pairs_per_program - 1):
        raise ValueError(f"pairs_per_program must be a power of two, got {pairs_per_program}")
    block_half = min(_p2(hd // 2), pairs_per_program)
    return block_half, triton.cdiv(hd // 2, block_half)


def _launch_args(codec_name: str, tokens: int, heads: int, dim: int, kind: Kind, params: LayoutParams):
    hdr = header_bytes(codec_name, tokens, heads, dim, params)
    a_page, r_page = page_block_bytes("lynx", params.page_tokens, heads, dim, kind, params)
    pages = -(-tokens // params.page_tokens)
    return hdr, a_page, r_page, pages


def encode(
    x: Tensor,
    kind: Kind,
    *,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    layer: int | None = None,
    codec_name: str = "lynx",
    rows_per_program: int = 64,
    pairs_per_program: int = PAIRS_PER_PROGRAM,
) -> EncodedKV:
    """``x[T, H, D]`` (bf16 / fp16 / fp32) -> the ``EncodedKV`` of ``get_codec(codec_name).encode(x, kind)``."""
    if codec_name not in CODEC_NAMES:
        raise ValueError(f"the lynx Triton kernels encode {', '.join(CODEC_NAMES)}, not {codec_name!r}")
    params = params or LayoutParams()
    alpha = _check_alpha(alpha)
    validate_input(x, kind, layer, params.page_tokens)
    _check_device(x)
    tokens, heads, dim = (int(s) for s in x.shape)
    group = _value_group(params, dim)  # checked for keys too: the reference rejects a bad size for both
    x = x.contiguous()
    a_len, r_len = stream_bytes("lynx", tokens, heads, dim, kind, params)
    anchor = torch.empty(a_len, dtype=torch.uint8, device=x.device)
    residual = torch.empty(r_len, dtype=torch.uint8, device=x.device)
    hdr, _, _, pages = _launch_args("lynx", tokens, heads, dim, kind, params)
    sink = sink_count("lynx", tokens, params)
    if sink:
        anchor[:hdr] = x[:sink].to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)
    if tokens:
        _encode_pages(x, kind, 0, pages, anchor, residual, params, alpha, layer, codec_name, group, rows_per_program,
                      pairs_per_program)
    trailer = trailer_bytes("lynx", tokens, heads, dim, params)
    if trailer:  # the layer trailer: the last recent_tokens tokens' residual bytes, repeated in the anchor
        anchor[a_len - trailer :] = residual[r_len - trailer :]
    if codec_name == "lynx-int4":
        residual = residual[:0]
    return EncodedKV(anchor, residual, tokens, heads, dim, kind, codec_name)


def encode_pages_into(
    x: Tensor,
    kind: Kind,
    first_page: int,
    count: int,
    anchor: Tensor,
    residual: Tensor,
    *,
    params: LayoutParams,
    layer: int | None = None,
    codec_name: str = "lynx",
    alpha: float = 0.0,
    rows_per_program: int = 64,
    pairs_per_program: int = PAIRS_PER_PROGRAM,
) -> None:
    """Write the page blocks of pages ``[first_page, first_page + count)`` of ``x[T, H, D]`` (the last page
    may be partial) at their offsets in the layer's streams ``anchor`` / ``residual`` (contiguous uint8 on
    ``x``'s device, at least the layer's ``lynx`` sizes), the bytes :func:`encode` writes there. Nothing
    else is written: not the header (the sink tokens), not the trailer. Only the rows of those pages are
    read, and their values are not checked for NaN / Inf (the caller does: ``codec.stream_parts``)."""
    if codec_name not in CODEC_NAMES:
        raise ValueError(f"the lynx Triton kernels encode {', '.join(CODEC_NAMES)}, not {codec_name!r}")
    alpha = _check_alpha(alpha)
    validate_input(x, kind, layer, params.page_tokens, values=False)
    _check_device(x, anchor, residual)
    tokens, heads, dim = (int(s) for s in x.shape)
    group = _value_group(params, dim)
    a_len, r_len = stream_bytes("lynx", tokens, heads, dim, kind, params)
    check_page_range(tokens, params.page_tokens, first_page, count, (("anchor", anchor, a_len),
                                                                     ("residual", residual, r_len)))
    _encode_pages(x.contiguous(), kind, first_page, count, anchor, residual, params, alpha, layer, codec_name, group,
                  rows_per_program, pairs_per_program)


def _encode_pages(x: Tensor, kind: Kind, first_page: int, count: int, anchor: Tensor, residual: Tensor,
                  params: LayoutParams, alpha: float, layer: int | None, codec_name: str, group: int,
                  rows_per_program: int, pairs_per_program: int) -> None:
    """Launch the encode kernel over pages ``[first_page, first_page + count)`` and check their peaks."""
    tokens, heads, dim = (int(s) for s in x.shape)
    hd = heads * dim
    hdr, a_page, r_page, _ = _launch_args("lynx", tokens, heads, dim, kind, params)
    log1p_alpha = math.log1p(alpha) if alpha > 0 else 1.0
    common = dict(P=params.page_tokens, HD=hd, COMPAND=alpha > 0)
    if kind == "k":
        chunk = key_chunk(params, KEY_CHUNK_FIELD)
        chunks = params.page_tokens // chunk
        block_half, pair_blocks = _pair_blocks(hd, pairs_per_program)
        peak = torch.zeros(count * chunks * pair_blocks, dtype=torch.float32, device=x.device)
        K.encode_keys_kernel[(count, chunks, pair_blocks)](
            x, anchor, residual, peak, tokens, first_page, hdr, a_page, r_page, alpha, log1p_alpha,
            C=chunk, S=params.sink_tokens, BLOCK_C=_p2(chunk),
            BLOCK_HALF=block_half, enable_fp_fusion=False, **common,
        )  # fmt: skip
    else:
        block_r = _p2(rows_per_program)
        blocks = triton.cdiv(params.page_tokens * hd // group, block_r)
        peak = torch.zeros(count * blocks, dtype=torch.float32, device=x.device)
        K.encode_values_kernel[(count, blocks)](
            x, anchor, residual, peak, tokens, first_page, hdr, a_page, r_page, alpha, log1p_alpha,
            G=group, BLOCK_R=block_r, BLOCK_G2=_p2(group // 2), enable_fp_fusion=False, **common,
        )  # fmt: skip
    _check_peak(peak.view(count, -1), codec_name, kind, layer, first_page)


def _check_peak(peak: Tensor, codec_name: str, kind: str, layer: int | None, first_page: int = 0) -> None:
    page_peak = peak.amax(dim=1)
    bad = page_peak > FP16_SAFE_ABS
    if bool(bad.any()):
        local = int(bad.nonzero()[0, 0])
        page = first_page + local
        where = f"layer {layer} {kind}" if layer is not None else kind
        raise ValueError(
            f"{codec_name} {where} page {page}: |value| up to {float(page_peak[local]):g} exceeds {FP16_SAFE_ABS:g}, "
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
    rows_per_program: int = 64,
    pairs_per_program: int = PAIRS_PER_PROGRAM,
) -> Tensor:
    """Dequantize one layer's K or V (``len(slot_indices)`` tokens) into ``pool[slot_indices]``.

    ``residual=None`` decodes anchor-only; with the residual, the full 8-bit reconstruction (an
    anchor-only page is upgraded in place by calling again with the residual). Returns ``pool``."""
    params = params or LayoutParams()
    alpha = _check_alpha(alpha)
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    if pool.dim() != 3 or pool.dtype not in ACCEPTED_DTYPES:
        raise ValueError(f"pool must be [slots, heads, head_dim] bf16/fp16/fp32, got {pool.dtype} {tuple(pool.shape)}")
    if pool.stride(2) != 1 or pool.stride(1) != pool.shape[2]:
        raise ValueError(f"pool rows must be contiguous [heads, head_dim], got strides {pool.stride()}")
    if slot_indices.dtype != torch.int64 or slot_indices.dim() != 1:
        raise TypeError(f"slot_indices must be 1-D int64, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    tokens, heads, dim = int(slot_indices.numel()), int(pool.shape[1]), int(pool.shape[2])
    group = _value_group(params, dim)
    for name, stream in (("anchor", anchor), ("residual", residual)):
        if stream is not None and (stream.dtype != torch.uint8 or stream.dim() != 1):
            raise TypeError(f"{name} must be a 1-D uint8 tensor, got {stream.dtype} {tuple(stream.shape)}")
    want_anchor, want_residual = stream_bytes("lynx", tokens, heads, dim, kind, params)
    if anchor.numel() != want_anchor:
        raise ValueError(f"lynx {kind}: anchor has {anchor.numel()} bytes, expected {want_anchor} for "
                         f"[{tokens}, {heads}, {dim}]")  # fmt: skip
    if residual is not None and residual.numel() != want_residual:
        raise ValueError(f"lynx {kind}: residual has {residual.numel()} bytes, expected {want_residual}")
    _check_device(anchor, pool, slot_indices, *([residual] if residual is not None else []))
    if tokens and (int(slot_indices.min()) < 0 or int(slot_indices.max()) >= pool.shape[0]):
        raise IndexError(f"slot_indices out of range [0, {pool.shape[0]})")
    if not tokens:
        return pool
    hd = heads * dim
    hdr, a_page, r_page, pages = _launch_args("lynx", tokens, heads, dim, kind, params)
    sink = sink_count("lynx", tokens, params)
    log1p_alpha = math.log1p(alpha) if alpha > 0 else 1.0
    if residual is None:  # anchor-only with a layer trailer: the residual it implies (nibble 7 elsewhere)
        residual = anchor_only_residual(anchor, tokens, heads, dim, params)
    res = residual if residual is not None else anchor  # never read when HAS_RES is False
    common = dict(P=params.page_tokens, HD=hd, HAS_RES=residual is not None, COMPAND=alpha > 0)
    pool_arg = pool.view(torch.int16) if pool.dtype == torch.bfloat16 else pool
    common["POOL_BF16"] = pool.dtype == torch.bfloat16
    args = (anchor, res, pool_arg, slot_indices, tokens, pool.stride(0), hdr, a_page, r_page, sink, alpha, log1p_alpha)
    if kind == "k":
        chunk = key_chunk(params, KEY_CHUNK_FIELD)
        chunks = params.page_tokens // chunk
        block_half, pair_blocks = _pair_blocks(hd, pairs_per_program)
        K.decode_keys_kernel[(pages, chunks, pair_blocks)](
            *args, C=chunk, BLOCK_C=_p2(chunk), BLOCK_HALF=block_half,
            enable_fp_fusion=False, **common,
        )  # fmt: skip
    else:
        block_r = _p2(rows_per_program)
        blocks = triton.cdiv(params.page_tokens * hd // group, block_r)
        K.decode_values_kernel[(pages, blocks)](
            *args, G=group, BLOCK_R=block_r, BLOCK_G2=_p2(group // 2), enable_fp_fusion=False, **common
        )
    return pool


def decode(
    enc: EncodedKV,
    *,
    with_residual: bool,
    params: LayoutParams | None = None,
    alpha: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """``codec.decode(enc, with_residual=..., dtype=...)`` through :func:`decode_into` (slots 0..T-1)."""
    out = torch.empty(enc.num_tokens, enc.num_heads, enc.head_dim, dtype=dtype, device=enc.anchor.device)
    slots = torch.arange(enc.num_tokens, dtype=torch.int64, device=enc.anchor.device)
    residual = enc.residual if with_residual and enc.codec != "lynx-int4" else None
    return decode_into(enc.anchor, residual, out, slots, kind=enc.kind, params=params, alpha=alpha)
