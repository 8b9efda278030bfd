"""Baseline codecs: bf16 (identity), int8 / int4 (group-wise asymmetric), kivi-int4 / kivi-int2.

All are one-stream (anchor only) and page-major (``layout``). Byte layout of one page block of
``n_p`` tokens (little-endian):

* ``bf16``: ``n_p * H * D`` bf16 values, order ``[token][head][dim]``.
* ``int8``, ``int4``: per-token groups of ``G = min(group_size, D)`` dims (order
  ``[token][head][group]``); ``mn`` -- fp16 per group, ``rng`` -- fp16 per group, then the codes
  (order ``[token][head][dim]``, 8 bits, or 4-bit nibbles two per byte, low nibble first).
* ``kivi-int4``, ``kivi-int2``: keys grouped per channel over chunks of ``C = chunk_tokens`` tokens
  (records ``[chunk][head][dim]``), values per token over ``G`` dims; same ``mn, rng, codes`` order,
  2-bit codes packed four per byte, element 4i + j in bits 2j..2j+1. Then the layer trailer: KIVI's
  full-precision residual, the bf16 values of the last ``min(kivi_recent_tokens, T)`` tokens (order
  ``[token][head][dim]``), which the decode writes over those tokens' quantized values (KIVI keeps the
  most recent R = 32-128 tokens unquantized; ``kivi_recent_tokens`` 0, the default, sends none).

Quantizer (every scheme here): ``mn = fp16 floor(min)``, ``rng = fp16 ceil(max - mn)``,
``q = clamp(ceil(u * L - 0.5), 0, L)`` with ``u = (x - mn) / rng`` (0 when rng == 0) and
``L = 2**bits - 1``; decode ``mn + q / L * rng``. Constant groups decode to ``mn`` exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KVCodec, describe
from .layout import Kind, num_groups, scheme_layout, token_group, trailer_count
from .quant_math import (
    as_bytes,
    check_fp16_range,
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


class Bf16Codec(KVCodec):
    name = "bf16"

    def _encode_pages(self, pages: Tensor, kind: Kind, first_page: int, layer: int | None) -> tuple[Tensor, Tensor]:
        empty = torch.empty(pages.shape[0], 0, dtype=torch.uint8, device=pages.device)
        return as_bytes(pages.to(torch.bfloat16)), empty

    def _decode_pages(
        self, anchor: Tensor, residual: Tensor | None, tokens: int, heads: int, dim: int, kind: Kind
    ) -> Tensor:
        return from_bytes(anchor, torch.bfloat16).float().view(-1, tokens, heads, dim)


class UniformCodec(KVCodec):
    """Asymmetric min/max uniform quantization with the grouping of the scheme's layout row."""

    def layer_trailer(self, x: Tensor, residual: Tensor) -> Tensor:
        count = trailer_count(self.name, int(x.shape[0]), self.params)  # KIVI's recent tokens (0 elsewhere)
        if count == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return as_bytes(x[x.shape[0] - count :].to(torch.bfloat16)).reshape(-1)

    def _apply_trailer(self, out: Tensor, trailer: Tensor) -> None:
        count = trailer_count(self.name, int(out.shape[0]), self.params)
        if count:
            out[out.shape[0] - count :] = from_bytes(trailer, torch.bfloat16).float().view(count, *out.shape[1:])

    def _grouping(self, kind: Kind) -> str:
        return scheme_layout(self.name).grouping(kind)

    def _bits(self) -> int:
        return scheme_layout(self.name).anchor_bits

    def _encode_pages(self, pages: Tensor, kind: Kind, first_page: int, layer: int | None) -> tuple[Tensor, Tensor]:
        n, t, _, d = pages.shape
        grouping, chunk, group = self._grouping(kind), self.params.chunk_tokens, token_group(self.params, d)
        levels = (1 << self._bits()) - 1
        view = grouped(pages, grouping, chunk, group)  # type: ignore[arg-type]
        lo = view.amin(dim=group_dim(grouping), keepdim=True)  # type: ignore[arg-type]
        hi = view.amax(dim=group_dim(grouping), keepdim=True)  # type: ignore[arg-type]
        what = f"{self.name} {describe(layer, kind)} pages from {first_page}"
        check_fp16_range(torch.cat([lo.reshape(-1), hi.reshape(-1)]), what)
        mn = fp16_floor(lo)
        rng = fp16_ceil(hi - mn.float())
        u = view.sub(mn.float()).div_(torch.where(rng > 0, rng.float(), 1.0)).clamp_(0.0, 1.0)
        q = ungrouped(u, grouping, t).reshape(n, -1).mul_(levels).sub_(0.5).ceil_().clamp_(0, levels)  # type: ignore[arg-type]
        anchor = torch.cat([as_bytes(mn), as_bytes(rng), pack_codes(q, self._bits())], dim=1)
        return anchor, torch.empty(n, 0, dtype=torch.uint8, device=pages.device)

    def _decode_pages(
        self, anchor: Tensor, residual: Tensor | None, tokens: int, heads: int, dim: int, kind: Kind
    ) -> Tensor:
        n = anchor.shape[0]
        grouping, chunk, group = self._grouping(kind), self.params.chunk_tokens, token_group(self.params, dim)
        groups = num_groups(grouping, tokens, heads, dim, self.params)  # type: ignore[arg-type]
        levels = (1 << self._bits()) - 1
        mn = from_bytes(anchor[:, : 2 * groups], torch.float16).float()
        rng = from_bytes(anchor[:, 2 * groups : 4 * groups], torch.float16).float()
        q = unpack_codes(anchor[:, 4 * groups :], self._bits()).float().div_(levels).view(n, tokens, heads, dim)
        u = grouped(pad_to_chunks(q, grouping, chunk), grouping, chunk, group)  # type: ignore[arg-type]
        shape = stat_shape(grouping, n, tokens, heads, dim, chunk, group)  # type: ignore[arg-type]
        return ungrouped(u.mul_(rng.view(shape)).add_(mn.view(shape)), grouping, tokens)  # type: ignore[arg-type]


class Int8Codec(UniformCodec):
    name = "int8"


class Int4Codec(UniformCodec):
    name = "int4"


class KiviInt4Codec(UniformCodec):
    name = "kivi-int4"


class KiviInt2Codec(UniformCodec):
    name = "kivi-int2"
