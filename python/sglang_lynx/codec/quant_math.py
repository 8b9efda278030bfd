"""Pure tensor helpers shared by the codecs: grouping, directed fp16 rounding, packing, rounding.

Everything here is a stateless function of its arguments (no globals, no threads), device-agnostic
(cpu, cuda, npu: only plain torch ops) and vectorised (no Python loop over tokens).

Conventions:

* ``pages`` tensors are ``[n_pages, page_tokens, num_heads, head_dim]`` float32.
* ``group_stats`` returns per-group tensors: ``token`` grouping ``[n, t, H, D // G]`` (order token,
  head, group), ``channel`` grouping ``[n, ceil(t / C), H, D]`` (order chunk, head, channel).
* Packing is little-endian inside a byte: element ``2i`` in the low nibble, ``2i + 1`` in the high
  nibble (for 2-bit codes: element ``4i + j`` in bits ``2j .. 2j + 1``).
* ``round_half_down(z) = ceil(z - 0.5)``: exact ties go to the lower integer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layout import Grouping

FP16_MAX = 65504.0
#: Largest input magnitude accepted by codecs with fp16 metadata: min and range must both fit fp16.
FP16_SAFE_ABS = 32000.0


def round_half_down(z: Tensor) -> Tensor:
    return torch.ceil(z - 0.5)


def fp16_step_down(h: Tensor) -> Tensor:
    """The next fp16 value towards -inf (0 and -0 go to the smallest negative subnormal)."""
    bits = h.view(torch.int16)
    positive = bits > 0
    is_zero = (bits == 0) | (bits == -32768)
    stepped = torch.where(positive, bits - 1, bits + 1)
    stepped = torch.where(is_zero, torch.full_like(bits, -32767), stepped)
    return stepped.view(torch.float16)


def fp16_floor(x: Tensor) -> Tensor:
    """Largest fp16 value <= x (x float32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, fp16_step_down(h), h)


def fp16_ceil(x: Tensor) -> Tensor:
    """Smallest fp16 value >= x (x float32)."""
    return -fp16_floor(-x)


def check_fp16_range(x: Tensor, what: str) -> None:
    peak = float(x.abs().amax()) if x.numel() else 0.0
    if peak > FP16_SAFE_ABS:
        raise ValueError(
            f"{what}: |value| up to {peak:g} exceeds {FP16_SAFE_ABS:g}, the largest magnitude this codec's "
            "fp16 metadata can describe; use the bf16 codec for such tensors"
        )


def _chunked(pages: Tensor, chunk: int) -> Tensor:
    """[n, t, H, D] -> [n, ceil(t/C), C, H, D], padding the last chunk by repeating its last token."""
    n, t, h, d = pages.shape
    chunks = -(-t // chunk)
    pad = chunks * chunk - t
    if pad:
        pages = torch.cat([pages, pages[:, -1:].expand(n, pad, h, d)], dim=1)
    return pages.view(n, chunks, chunk, h, d)


def grouped(pages: Tensor, grouping: Grouping, chunk: int, group: int) -> Tensor:
    """Broadcastable 5-D view: ``token`` -> ``[n, t, H, D/G, G]``; ``channel`` -> ``[n, ceil(t/C), C, H, D]``
    (a partial last chunk is padded by repeating its last token, which changes no min or max)."""
    n, t, h, d = pages.shape
    if grouping == "token":
        return pages.reshape(n, t, h, d // group, group)
    return _chunked(pages, chunk)


def group_dim(grouping: Grouping) -> int:
    """The dimension of :func:`grouped` that runs inside a group."""
    return 4 if grouping == "token" else 2


def ungrouped(values: Tensor, grouping: Grouping, tokens: int) -> Tensor:
    """Inverse of :func:`grouped`: 5-D -> ``[n, tokens, H, D]`` (drops the chunk padding)."""
    if grouping == "token":
        n, t, h, g, size = values.shape
        return values.reshape(n, t, h, g * size)
    n, c, size, h, d = values.shape
    return values.reshape(n, c * size, h, d)[:, :tokens]


def stat_shape(
    grouping: Grouping, n: int, tokens: int, heads: int, dim: int, chunk: int, group: int
) -> tuple[int, ...]:
    """Shape of per-group statistics that broadcasts against :func:`grouped`."""
    if grouping == "token":
        return (n, tokens, heads, dim // group, 1)
    return (n, -(-tokens // chunk), 1, heads, dim)


def pad_to_chunks(pages: Tensor, grouping: Grouping, chunk: int) -> Tensor:
    """Zero-pad the token dim to whole chunks (``channel`` grouping), so :func:`grouped` is a pure view."""
    if grouping != "channel" or pages.shape[1] % chunk == 0:
        return pages
    n, t, h, d = pages.shape
    return torch.cat([pages, pages.new_zeros(n, chunk - t % chunk, h, d)], dim=1)


def chunk_mean(pages: Tensor, chunk: int) -> Tensor:
    """Per (chunk, channel) mean over the chunk's real tokens: ``[n, ceil(t/C), H, D]``."""
    n, t, h, d = pages.shape
    chunks = -(-t // chunk)
    pad = chunks * chunk - t
    padded = torch.cat([pages, pages.new_zeros(n, pad, h, d)], dim=1) if pad else pages
    sums = padded.view(n, chunks, chunk, h, d).sum(dim=2)
    counts = torch.full((chunks,), float(chunk), device=pages.device)
    counts[-1] = chunk - pad
    return sums / counts.view(1, chunks, 1, 1)


def chunk_absmax(pages: Tensor, chunk: int) -> Tensor:
    return _chunked(pages.abs(), chunk).amax(dim=2)


def expand_groups(stat: Tensor, grouping: Grouping, tokens: int, chunk: int, group: int) -> Tensor:
    """Broadcast a per-group tensor back to ``[n, tokens, H, D]``."""
    if grouping == "token":
        n, t, h, g = stat.shape
        return stat.unsqueeze(-1).expand(n, t, h, g, group).reshape(n, t, h, g * group)
    n, c, h, d = stat.shape
    return stat.unsqueeze(2).expand(n, c, chunk, h, d).reshape(n, c * chunk, h, d)[:, :tokens]


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """``[n, m]`` integer codes of ``bits`` (2, 4 or 8) bits -> ``[n, m * bits / 8]`` uint8."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if bits == 4:
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    if bits == 2:
        return codes[:, 0::4] | (codes[:, 1::4] << 2) | (codes[:, 2::4] << 4) | (codes[:, 3::4] << 6)
    raise ValueError(f"cannot pack {bits}-bit codes")


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``[n, b]`` uint8 -> ``[n, b * 8 / bits]`` uint8 codes."""
    if bits == 8:
        return packed
    n, b = packed.shape
    if bits == 4:
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(n, 2 * b)
    if bits == 2:
        parts = [(packed >> shift) & 0x03 for shift in (0, 2, 4, 6)]
        return torch.stack(parts, dim=-1).view(n, 4 * b)
    raise ValueError(f"cannot unpack {bits}-bit codes")


def as_bytes(t: Tensor) -> Tensor:
    """``[n, ...]`` tensor of any dtype -> ``[n, bytes]`` uint8 view (contiguous)."""
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8)


def from_bytes(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n, bytes]`` uint8 (any offset) -> ``[n, bytes / itemsize]`` of ``dtype``."""
    return (
        raw.contiguous().view(dtype)
        if raw.is_contiguous() and raw.storage_offset() % 8 == 0
        else (raw.clone().view(dtype))
    )


def compand(u: Tensor, alpha: float) -> Tensor:
    """Alpha-law on the centred coordinate: u in [0, 1] -> [0, 1]; identity at alpha = 0."""
    if alpha == 0.0:
        return u
    t = 2.0 * u - 1.0
    y = torch.sign(t) * torch.log1p(alpha * t.abs()) / torch.log1p(torch.tensor(alpha)).item()
    return (y + 1.0) * 0.5


def expand_companded(u: Tensor, alpha: float) -> Tensor:
    """Inverse of :func:`compand`."""
    if alpha == 0.0:
        return u
    y = 2.0 * u - 1.0
    log1p_alpha = torch.log1p(torch.tensor(alpha)).item()
    t = torch.sign(y) * torch.expm1(y.abs() * log1p_alpha) / alpha
    return (t + 1.0) * 0.5
