"""``lynx``: the reference encoder/decoder of our two-stream codec, with its exact byte layout.

This module is THE reference the Triton kernels (``kernels/``) must reproduce. It is pure: functions
of their arguments, float32 arithmetic, device-agnostic torch.

Parameters (``LayoutParams`` + ``alpha``): P = page_tokens (256), C = min(key_chunk_tokens, P) (64; NOT
chunk_tokens, which sizes the KIVI / lynx-paper key chunks), G = min(value_group_size, head_dim) (64; NOT
group_size, which sizes the int8/int4 baselines),
S = sink_tokens (1), R = recent_tokens (48), alpha (0.0). T, H, D = num_tokens,
num_heads, head_dim; H * D must be a multiple of 4 and G must divide D.

Groups (one metadata record each):

* keys (``kind == "k"``): per channel, per chunk -- C consecutive tokens of one (head, dim) channel
  inside a page (the last chunk of a partial page holds the remaining tokens). Records are ordered
  ``[chunk][head][dim]``.
* values (``kind == "v"``): per token -- G consecutive dims of one (token, head). Records are
  ordered ``[token][head][group]``.

Encoding one value x of a group (all arithmetic float32):

1. ``lo, hi`` = min and max of the group. On page 0 the first S tokens (the attention sink) are
   left out of the key statistics (they are replaced by token S of that page; when the page has no
   token S they are kept).
2. ``mn = fp16 rounded towards -inf of lo``; ``rng = fp16 rounded towards +inf of (hi - float(mn))``.
3. ``u = clamp((x - mn) / rng, 0, 1)``, or ``u = 0`` when ``rng == 0``.
4. Companding (identity when alpha == 0): ``t = 2u - 1``,
   ``u <- (sign(t) * ln(1 + alpha |t|) / ln(1 + alpha) + 1) / 2``.
5. Anchor code ``a = clamp(ceil(15 u - 0.5), 0, 15)`` (round half down onto 16 levels a / 15, both
   extremes exact). Full code ``f = clamp(ceil(225 u - 0.5), 0, 225)``. Residual code
   ``r = clamp(f - 15 a, -7, 7) + 7`` (centred signed correction, bias +7; nibble 15 is unused).
6. Decode: anchor-only ``u' = a / 15``; full ``u' = (15 a + r - 7) / 225``; inverse companding
   ``t = 2u' - 1``, ``u' <- (sign(t) * ((1 + alpha)^|t| - 1) / alpha + 1) / 2``;
   ``x' = float(mn) + u' * float(rng)``. A constant group (rng == 0) decodes to ``mn`` exactly.
7. The first S tokens are then overwritten by their exact bf16 copy from the layer header.
8. Recent tokens: an anchor-only decode of the last ``min(R, T)`` tokens uses their residual codes,
   which the layer trailer carries in the anchor stream, i.e. it equals the full decode there (the
   attention of the drafted tokens leans on the recent ones). Implementation: the anchor-only decode
   is the full decode of a synthetic residual stream (:func:`anchor_only_residual`) whose nibbles are
   7 everywhere but the last R tokens (from the trailer); ``r = 7`` gives ``u' = 15 a / 225``, which in
   IEEE float32 is bit-identical to ``a / 15`` (both are the correctly rounded same quotient).

Byte layout of one layer (little-endian; "nibbles" = 4-bit codes packed two per byte, element 2i
in the low nibble, element 2i + 1 in the high nibble):

* anchor stream =
  ``header`` -- ``min(S, T) * H * D`` bf16 values of the first tokens, order ``[token][head][dim]``;
  then for each page p (``P`` tokens; the last page holds ``T - P * floor(T / P)`` if nonzero), with
  ``n_p`` tokens and ``g_p`` groups (keys ``ceil(n_p / C) * H * D``, values ``n_p * H * D / G``):
  ``mn``  -- ``g_p`` fp16 (2 g_p bytes), group order above;
  ``rng`` -- ``g_p`` fp16 (2 g_p bytes);
  ``a``   -- ``n_p * H * D`` nibbles (``n_p * H * D / 2`` bytes), order ``[token][head][dim]``;
  then ``trailer`` -- the last ``min(R, T) * H * D / 2`` bytes of the residual stream below (the
  residual nibbles of the last ``min(R, T)`` tokens, order ``[token][head][dim]``), computed also for
  ``lynx-int4``, whose residual stream is never sent.
* residual stream = for each page p: ``r`` -- ``n_p * H * D`` nibbles, order ``[token][head][dim]``.

Bits per value (T = 1024, H = 3, D = 64, defaults): keys 4 + 32 / C = 4.5, values 4 + 32 / G = 4.5,
plus the header 16 S / T and the trailer 4 min(R, T) / T (anchor 4.516 + 4 R / 1024 = 4.70 at T = 1024);
the residual stream adds exactly 4, of which the wire leaves out the 4 min(R, T) / T the trailer already
carries (``wire_residual``): anchor + residual on the wire = 8.5 + 16 S / T (8.516 at T = 1024).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layout import Grouping, Kind, LayoutParams, key_chunk, num_groups, token_group, trailer_count
from .quant_math import (
    as_bytes,
    check_fp16_range,
    compand,
    expand_companded,
    fp16_ceil,
    fp16_floor,
    from_bytes,
    group_dim,
    grouped,
    pack_codes,
    pad_to_chunks,
    stat_shape,
    ungrouped,
    unpack_codes,
)

ANCHOR_LEVELS = 15  # anchor code a in 0..15 -> u = a / 15
FULL_LEVELS = 225  # full code 15 a + (r - 7) -> u = f / 225
RESIDUAL_BIAS = 7
VALUE_GROUP_FIELD = "value_group_size"
KEY_CHUNK_FIELD = "key_chunk_tokens"


def grouping_of(kind: Kind) -> Grouping:
    return "channel" if kind == "k" else "token"


def encode_header(x: Tensor, params: LayoutParams) -> Tensor:
    """Exact (bf16) copy of the first ``sink_tokens`` tokens, as bytes."""
    sink = min(params.sink_tokens, int(x.shape[0]))
    return x[:sink].to(torch.bfloat16).contiguous().view(-1).view(torch.uint8)


def apply_header(out: Tensor, header: Tensor) -> None:
    if header.numel():
        heads, dim = out.shape[1], out.shape[2]
        exact = header.contiguous().view(torch.bfloat16).view(-1, heads, dim)
        out[: exact.shape[0]] = exact.float()


def trailer_from_residual(residual: Tensor, tokens: int, heads: int, dim: int, params: LayoutParams) -> Tensor:
    """The layer trailer: the last ``min(R, T) * H * D / 2`` bytes of the layer's residual stream (the
    residual nibbles of the last R tokens, since the residual stream runs ``[token][head][dim]``)."""
    count = trailer_count("lynx", tokens, params) * heads * dim // 2
    return residual[residual.numel() - count :] if count else residual[:0]


def anchor_only_residual(anchor: Tensor, tokens: int, heads: int, dim: int, params: LayoutParams) -> Tensor | None:
    """The residual stream an anchor-only decode reads: every nibble 7 (correction 0, which decodes to
    exactly the anchor-only value) except the last R tokens, taken from the trailer; None when R = 0."""
    count = trailer_count("lynx", tokens, params) * heads * dim // 2
    if not count:
        return None
    residual = torch.full((tokens * heads * dim // 2,), 0x77, dtype=torch.uint8, device=anchor.device)
    residual[residual.numel() - count :] = anchor[anchor.numel() - count :]
    return residual


def _stats(pages: Tensor, kind: Kind, first_page: int, params: LayoutParams) -> tuple[Tensor, Tensor]:
    """Per-group (lo, hi) as broadcastable 5-D tensors, the sink left out of page 0's key statistics."""
    grouping = grouping_of(kind)
    chunk, group, dim = (
        key_chunk(params, KEY_CHUNK_FIELD),
        token_group(params, pages.shape[-1], VALUE_GROUP_FIELD),
        group_dim(grouping),
    )  # type: ignore[arg-type]
    view = grouped(pages, grouping, chunk, group)  # type: ignore[arg-type]
    lo, hi = view.amin(dim=dim, keepdim=True), view.amax(dim=dim, keepdim=True)
    sink = params.sink_tokens
    if first_page == 0 and kind == "k" and 0 < sink < pages.shape[1]:
        first = pages[:1].clone()
        first[0, :sink] = pages[0, sink]
        first_view = grouped(first, grouping, chunk, group)  # type: ignore[arg-type]
        lo[:1] = first_view.amin(dim=dim, keepdim=True)
        hi[:1] = first_view.amax(dim=dim, keepdim=True)
    return lo, hi


def encode_pages(
    pages: Tensor, kind: Kind, first_page: int, params: LayoutParams, alpha: float, what: str
) -> tuple[Tensor, Tensor]:
    """``[n, t, H, D]`` float32 pages -> (anchor blocks ``[n, A]``, residual blocks ``[n, t*H*D/2]``)."""
    n, t = pages.shape[0], pages.shape[1]
    grouping = grouping_of(kind)
    chunk, group = key_chunk(params, KEY_CHUNK_FIELD), token_group(params, pages.shape[-1], VALUE_GROUP_FIELD)
    lo, hi = _stats(pages, kind, first_page, params)
    check_fp16_range(torch.cat([lo.reshape(-1), hi.reshape(-1)]), what)
    mn = fp16_floor(lo)
    rng = fp16_ceil(hi - mn.float())
    rng_safe = torch.where(rng > 0, rng.float(), 1.0)
    u = grouped(pages, grouping, chunk, group).sub(mn.float()).div_(rng_safe).clamp_(0.0, 1.0)  # type: ignore[arg-type]
    u = compand(ungrouped(u, grouping, t).reshape(n, -1), alpha)  # type: ignore[arg-type]
    a = (u * ANCHOR_LEVELS).sub_(0.5).ceil_().clamp_(0, ANCHOR_LEVELS)
    r = (u * FULL_LEVELS).sub_(0.5).ceil_().clamp_(0, FULL_LEVELS)
    r.sub_(a * ANCHOR_LEVELS).clamp_(-RESIDUAL_BIAS, RESIDUAL_BIAS).add_(RESIDUAL_BIAS)
    anchor = torch.cat([as_bytes(mn), as_bytes(rng), pack_codes(a, 4)], dim=1)
    return anchor, pack_codes(r, 4)


def decode_pages(
    anchor: Tensor,
    residual: Tensor | None,
    tokens: int,
    heads: int,
    dim: int,
    kind: Kind,
    params: LayoutParams,
    alpha: float,
) -> Tensor:
    """Inverse of :func:`encode_pages` (anchor-only when ``residual`` is None): float32 pages."""
    n = anchor.shape[0]
    grouping = grouping_of(kind)
    chunk, group = key_chunk(params, KEY_CHUNK_FIELD), token_group(params, dim, VALUE_GROUP_FIELD)
    groups = num_groups(grouping, tokens, heads, dim, params, VALUE_GROUP_FIELD, KEY_CHUNK_FIELD)  # type: ignore[arg-type]
    mn = from_bytes(anchor[:, : 2 * groups], torch.float16).float()
    rng = from_bytes(anchor[:, 2 * groups : 4 * groups], torch.float16).float()
    u = unpack_codes(anchor[:, 4 * groups :], 4).float()
    if residual is None:
        u.div_(ANCHOR_LEVELS)
    else:
        u.mul_(ANCHOR_LEVELS).add_(unpack_codes(residual, 4).float()).sub_(RESIDUAL_BIAS).div_(FULL_LEVELS)
    u = expand_companded(u, alpha).view(n, tokens, heads, dim)
    u = grouped(pad_to_chunks(u, grouping, chunk), grouping, chunk, group)  # type: ignore[arg-type]
    shape = stat_shape(grouping, n, tokens, heads, dim, chunk, group)  # type: ignore[arg-type]
    x = u.mul_(rng.view(shape)).add_(mn.view(shape))
    return ungrouped(x, grouping, tokens)  # type: ignore[arg-type]
