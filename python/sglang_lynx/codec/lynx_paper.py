"""``lynx-paper``: the paper's hierarchical non-linear codec, faithfully, as a reference mode.

Per layer and kind, per channel (one (head, dim) coordinate), all arithmetic float32:

1. Page normalisation (P tokens): ``pmin = fp16 floor(min)``, ``pscale = fp16 ceil(max - pmin)``,
   ``xn = (x - pmin) / pscale`` in [0, 1] (0 when pscale == 0).
2. Chunk outlier isolation (C tokens): ``mu = fp16(mean(xn))`` (round to nearest),
   ``sigma = fp16 ceil(max |xn - mu|)``; ``t = clamp((xn - mu) / sigma, -1, 1)`` (0 when sigma == 0).
3. Alpha-law: ``y = sign(t) ln(1 + alpha |t|) / ln(1 + alpha)`` (``y = t`` when alpha == 0).
4. 8-bit sign-magnitude code: ``m = 8 |y|``; ``seg = min(floor(m), 7)``;
   ``r = clamp(ceil(16 (m - seg) - 1), 0, 15)`` (16 linear steps inside the segment, a value exactly
   on a step edge goes to the lower step: round half down of the centred correction, i.e. the
   correction from the segment midpoint is ``(r - 7.5) / 16`` of a segment, stored with bias +7 as
   the nibble r); ``sign = 1 if t < 0`` (so small negative values keep a distinct "-0" code).
   ``byte = sign << 7 | seg << 4 | r``: the anchor nibble is ``sign << 3 | seg`` (sign + geometric
   segment; segment k spans |t| in [((1+alpha)^(k/8) - 1)/alpha, ((1+alpha)^((k+1)/8) - 1)/alpha]),
   the residual nibble is ``r``.
5. Decode: anchor-only ``m' = seg + 0.5``; full ``m' = seg + (r + 0.5) / 16``; ``y' = +-m' / 8``;
   ``t' = sign(y') ((1 + alpha)^|y'| - 1) / alpha``; ``x' = pmin + pscale (mu + sigma t')``.

Byte layout of one page block of ``n_p`` tokens (little-endian, nibbles low first):

* anchor: ``pmin`` fp16 ``[head][dim]``; ``pscale`` fp16 ``[head][dim]``; ``mu`` fp16
  ``[chunk][head][dim]``; ``sigma`` fp16 ``[chunk][head][dim]``; anchor nibbles ``[token][head][dim]``.
* residual: residual nibbles ``[token][head][dim]``.

Metadata: 2 x 16 bits per channel per page + 2 x 16 bits per channel per chunk, i.e. 4 + 1.125 bits
per value for the anchor at P = 256, C = 32. Constant pages and channels decode exactly to pmin.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import KVCodec, describe
from .layout import Kind, LayoutParams
from .quant_math import (
    as_bytes,
    check_fp16_range,
    chunk_absmax,
    chunk_mean,
    expand_groups,
    fp16_ceil,
    fp16_floor,
    from_bytes,
    pack_codes,
    unpack_codes,
)


def _compand(t: Tensor, alpha: float) -> Tensor:
    if alpha == 0.0:
        return t
    return torch.sign(t) * torch.log1p(alpha * t.abs()) / torch.log1p(torch.tensor(alpha)).item()


def _expand(y: Tensor, alpha: float) -> Tensor:
    if alpha == 0.0:
        return y
    return torch.sign(y) * torch.expm1(y.abs() * torch.log1p(torch.tensor(alpha)).item()) / alpha


class LynxPaperCodec(KVCodec):
    name = "lynx-paper"
    progressive = True
    two_streams = True

    def __init__(self, params: LayoutParams | None = None, *, alpha: float = 3.0, **extra: Any) -> None:
        super().__init__(params, **extra)
        self.alpha = float(alpha)

    def _encode_pages(self, pages: Tensor, kind: Kind, first_page: int, layer: int | None) -> tuple[Tensor, Tensor]:
        check_fp16_range(pages, f"{self.name} {describe(layer, kind)} pages from {first_page}")
        n, t, h, d = pages.shape
        chunk = self.params.chunk_tokens
        pmin = fp16_floor(pages.amin(dim=1))
        pscale = fp16_ceil(pages.amax(dim=1) - pmin.float())
        scale = pscale.float().unsqueeze(1)
        xn = torch.where(scale > 0, (pages - pmin.float().unsqueeze(1)) / torch.where(scale > 0, scale, 1.0), 0.0)
        mu = chunk_mean(xn, chunk).to(torch.float16)
        mu_full = expand_groups(mu.float(), "channel", t, chunk, 1)
        centred = xn - mu_full
        sigma = fp16_ceil(chunk_absmax(centred, chunk))
        sigma_full = expand_groups(sigma.float(), "channel", t, chunk, 1)
        tt = torch.where(sigma_full > 0, centred / torch.where(sigma_full > 0, sigma_full, 1.0), 0.0)
        tt = tt.clamp_(-1.0, 1.0)
        m = _compand(tt, self.alpha).abs() * 8.0
        seg = torch.floor(m).clamp_(max=7)
        r = torch.ceil(16.0 * (m - seg) - 1.0).clamp_(0, 15)
        sign = (tt < 0).to(torch.float32)
        anchor_codes = (sign * 8 + seg).view(n, -1)
        anchor = torch.cat(
            [as_bytes(pmin), as_bytes(pscale), as_bytes(mu), as_bytes(sigma), pack_codes(anchor_codes, 4)],
            dim=1,
        )
        return anchor, pack_codes(r.view(n, -1), 4)

    def _decode_pages(
        self, anchor: Tensor, residual: Tensor | None, tokens: int, heads: int, dim: int, kind: Kind
    ) -> Tensor:
        n = anchor.shape[0]
        chunk = self.params.chunk_tokens
        channels = heads * dim
        chunks = -(-tokens // chunk)
        sizes = [channels, channels, chunks * channels, chunks * channels]
        fields = []
        offset = 0
        for size in sizes:
            fields.append(from_bytes(anchor[:, offset : offset + 2 * size], torch.float16).float())
            offset += 2 * size
        pmin, pscale, mu, sigma = fields
        codes = unpack_codes(anchor[:, offset:], 4).float().view(n, tokens, heads, dim)
        sign = torch.where(codes >= 8, -1.0, 1.0)
        seg = codes - 8 * (codes >= 8)
        if residual is None:
            m = seg + 0.5
        else:
            r = unpack_codes(residual, 4).float().view(n, tokens, heads, dim)
            m = seg + (r + 0.5) / 16.0
        tt = _expand(sign * m / 8.0, self.alpha)
        mu_full = expand_groups(mu.view(n, chunks, heads, dim), "channel", tokens, chunk, 1)
        sigma_full = expand_groups(sigma.view(n, chunks, heads, dim), "channel", tokens, chunk, 1)
        xn = torch.addcmul(mu_full, sigma_full, tt)
        return torch.addcmul(pmin.view(n, 1, heads, dim), pscale.view(n, 1, heads, dim), xn)
