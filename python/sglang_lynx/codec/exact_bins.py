"""The BF16 values inside each ``lynx`` quantization bin: the math under the ``lynx-exact`` stream.

Pure tensor functions (float32 / float64 / int32, device-agnostic torch), no state. ``lynx_exact``
frames and entropy-codes what they compute.

Given a layer's ``lynx`` anchor and residual streams, the decoder knows for every value its group's
fp16 ``mn`` and ``rng`` and its 8-bit full code ``f = 15 a + r - 7`` (0..225). The encoder's code is a
monotone non-decreasing function of the input value (``lynx_format`` steps 3-5 at alpha 0, float32):
``code(v) = 15 a(v) + clamp(f(v) - 15 a(v), -7, 7)`` with ``u = clamp((v - mn) / rng, 0, 1)``. So the
BF16 values that share a code form one contiguous run of the BF16 *ordinals* (the monotone
bijection of the 16-bit patterns onto 0..65535, ``-0`` just below ``+0``, see :func:`ordinal`), and
every value of a group lies in ``[mn, mn + rng]``. The *bin* of a value is::

    L = max(lower(f), cap_lo)                  cap_lo = the first ordinal whose value is >= mn
    U = min(lower(f + 1) - 1, cap_hi)          cap_hi = the last ordinal whose value is <= mn + rng
                                               (f = 225: U = cap_hi; f = 0: lower(0) = cap_lo)

where ``lower(f)`` is the first ordinal whose code is >= f. ``lower`` and the caps are computed the
same way on both sides: an analytic estimate (nearest BF16 to ``mn + rng (f - 1/2) / 225``, resp.
to ``mn`` and ``mn + rng``) corrected inside a window of ``WINDOW`` ordinals either side by counting
the window's ordinals below the boundary with the encoder's own float32 code. The count ``n = U - L + 1``
and the rank ``ordinal(x) - L`` are what the exact stream carries. Should a value ever fall outside
its computed bin (float corner cases: a boundary farther than ``WINDOW`` from its estimate, an
``mn + rng`` the float32 range rounding left below the group max, a key sink excluded from page 0's
statistics) the stream *escapes* it (stores its 16 bits); losslessness never rests on the window.

Only alpha = 0 (the default, linear code) is handled: ``lynx-exact`` refuses alpha > 0 in its config.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .layout import Kind, LayoutParams, key_chunk, num_groups, page_block_bytes, page_sizes, token_group
from .lynx_format import ANCHOR_LEVELS, FULL_LEVELS, KEY_CHUNK_FIELD, RESIDUAL_BIAS, VALUE_GROUP_FIELD, grouping_of
from .quant_math import expand_groups, from_bytes, unpack_codes

WINDOW = 2  # ordinals searched either side of each boundary estimate (part of the stream's definition)
ORD_MIN_FINITE = 0x0080  # ordinal of -max finite bf16 (0x0000..0x007F: NaN and -inf)
ORD_MAX_FINITE = 0xFF7F  # ordinal of +max finite bf16 (0xFF80..: +inf and NaN)


def ordinal(bits: Tensor) -> Tensor:
    """bf16 bit patterns (int16 / int32) -> int32 ordinals 0..65535 in the order of the values;
    ``-0`` is ordinal 0x7FFF and ``+0`` 0x8000."""
    b = bits.to(torch.int32) & 0xFFFF
    return torch.where(b < 0x8000, b + 0x8000, 0xFFFF - b)


def from_ordinal(ords: Tensor) -> Tensor:
    """Inverse of :func:`ordinal`: int32 ordinals -> int16 bf16 bit patterns."""
    b = torch.where(ords >= 0x8000, ords - 0x8000, 0xFFFF - ords)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16)


@functools.lru_cache(maxsize=8)
def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(ordinal of each 16-bit pattern, float32 value of each ordinal; NaN / inf ordinals clamped to the
    finite range): lookup tables equal to :func:`ordinal` / :func:`from_ordinal`, built once per device."""
    every = torch.arange(65536, dtype=torch.int32, device=device)
    values = from_ordinal(every.clamp(ORD_MIN_FINITE, ORD_MAX_FINITE)).view(torch.bfloat16).float()
    return ordinal(every), values


def bf16_ordinals(x: Tensor) -> Tensor:
    """int32 ordinals of a bf16 tensor's values."""
    patterns = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return _tables(x.device)[0][patterns]


def ordinal_values(ords: Tensor) -> Tensor:
    """float32 values of int32 ordinals (clamped to the finite range)."""
    return _tables(ords.device)[1][ords.clamp(0, 0xFFFF)]


def code_of(v: Tensor, mn: Tensor, rng: Tensor) -> Tensor:
    """The ``lynx`` full code (int32, 0..225) the encoder gives a float32 value ``v`` of a group with
    float32 ``mn`` / ``rng``: the same float32 operations as ``lynx_format.encode_pages`` at alpha 0."""
    rng_safe = torch.where(rng > 0, rng, 1.0)
    u = (v - mn).div_(rng_safe).clamp_(0.0, 1.0)
    a = (u * ANCHOR_LEVELS).sub_(0.5).ceil_().clamp_(0, ANCHOR_LEVELS)
    f = (u * FULL_LEVELS).sub_(0.5).ceil_().clamp_(0, FULL_LEVELS)
    f.sub_(a * ANCHOR_LEVELS).clamp_(-RESIDUAL_BIAS, RESIDUAL_BIAS).add_(a * ANCHOR_LEVELS)
    return f.to(torch.int32)


def _window(estimate: Tensor) -> Tensor:
    """``[..., 2W + 1]`` ordinals ``estimate - W .. estimate + W``."""
    offsets = torch.arange(-WINDOW, WINDOW + 1, dtype=torch.int32, device=estimate.device)
    return estimate.unsqueeze(-1) + offsets


def _nearest_ordinal(target: Tensor) -> Tensor:
    """Ordinal of the bf16 nearest to a float64 target (an estimate: rounded through float32)."""
    return bf16_ordinals(target.float().clamp(-3.0e38, 3.0e38).to(torch.bfloat16))


def lower_bound(code: Tensor, mn: Tensor, rng: Tensor) -> Tensor:
    """``lower(f)``: the first ordinal whose code is >= ``code`` (found in the window of the estimate)."""
    target = mn.double() + rng.double() * ((code.double() - 0.5) / FULL_LEVELS)
    ords = _window(_nearest_ordinal(target))
    below = code_of(ordinal_values(ords), mn.unsqueeze(-1), rng.unsqueeze(-1)) < code.unsqueeze(-1)
    return ords[..., 0] + below.sum(-1, dtype=torch.int32)


def group_caps(mn: Tensor, rng: Tensor) -> tuple[Tensor, Tensor]:
    """(cap_lo, cap_hi): first ordinal with value >= mn, last with value <= mn + rng (float64, exact)."""
    lo, hi = mn.double(), mn.double() + rng.double()
    lo_ords, hi_ords = _window(_nearest_ordinal(lo)), _window(_nearest_ordinal(hi))
    cap_lo = lo_ords[..., 0] + (ordinal_values(lo_ords).double() < lo.unsqueeze(-1)).sum(-1, dtype=torch.int32)
    cap_hi = hi_ords[..., 0] + (ordinal_values(hi_ords).double() <= hi.unsqueeze(-1)).sum(-1, dtype=torch.int32)
    return cap_lo, cap_hi - 1


def bins(code: Tensor, mn: Tensor, rng: Tensor) -> tuple[Tensor, Tensor]:
    """(L, n) per value: the first ordinal of the value's bin and its BF16 count (n < 1: empty bin)."""
    cap_lo, cap_hi = group_caps(mn, rng)
    first = torch.where(code > 0, lower_bound(code, mn, rng), cap_lo)
    after = torch.where(code < FULL_LEVELS, lower_bound(code + 1, mn, rng), cap_hi + 1)
    first = torch.maximum(first, cap_lo)
    last = torch.minimum(after - 1, cap_hi)
    return first, last - first + 1


def value_fields(
    anchor: Tensor, residual: Tensor, tokens: int, heads: int, dim: int, kind: Kind, params: LayoutParams
) -> tuple[Tensor, Tensor, Tensor]:
    """Per value ``[T, H, D]``: the group's float32 ``mn`` and ``rng`` and the int32 full code, read from a
    layer's whole ``lynx`` anchor and residual streams (the layout of ``lynx_format``)."""
    grouping = grouping_of(kind)
    chunk, group = key_chunk(params, KEY_CHUNK_FIELD), token_group(params, dim, VALUE_GROUP_FIELD)
    mn_out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=anchor.device)
    rng_out = torch.empty_like(mn_out)
    code_out = torch.empty(tokens, heads, dim, dtype=torch.int32, device=anchor.device)
    a_off = min(params.sink_tokens, tokens) * heads * dim * 2  # the layer header
    r_off = start = 0
    for tok in page_sizes(tokens, params.page_tokens):
        a_bytes = page_block_bytes("lynx", tok, heads, dim, kind, params)[0]
        r_bytes = tok * heads * dim // 2
        block = anchor[a_off : a_off + a_bytes].view(1, a_bytes)
        groups = num_groups(grouping, tok, heads, dim, params, VALUE_GROUP_FIELD, KEY_CHUNK_FIELD)
        stats = []
        for part in (block[:, : 2 * groups], block[:, 2 * groups : 4 * groups]):
            stat = from_bytes(part, torch.float16).float()
            shape = (1, tok, heads, dim // group) if grouping == "token" else (1, -(-tok // chunk), heads, dim)
            stats.append(expand_groups(stat.view(shape), grouping, tok, chunk, group)[0])
        a = unpack_codes(block[:, 4 * groups :], 4).to(torch.int32)
        r = unpack_codes(residual[r_off : r_off + r_bytes].view(1, r_bytes), 4).to(torch.int32)
        mn_out[start : start + tok], rng_out[start : start + tok] = stats
        code_out[start : start + tok] = (a * ANCHOR_LEVELS + r - RESIDUAL_BIAS).view(tok, heads, dim)
        a_off += a_bytes
        r_off += r_bytes
        start += tok
    return mn_out, rng_out, code_out
