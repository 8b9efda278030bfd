"""``KVCodec`` wrappers of the ``lynx`` format (``lynx_format``): lynx, lynx-int4, lynx-int8.

* ``lynx``      -- progressive: anchor + residual streams, drafts decode anchor-only.
* ``lynx-int8`` -- the same two streams, always decoded full (no speculation).
* ``lynx-int4`` -- the anchor stream only (the residual is never produced nor sent).
* ``lynx-exact`` -- ``lynx``'s two streams plus the exact stream (``lynx_exact``): anchor + residual +
  exact restore the BF16 input bit for bit (BF16 input, alpha 0 only).

All three share one byte format; only which streams exist and how they are decoded differ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import lynx_exact, lynx_format
from .base import EncodedKV, KVCodec, describe
from .layout import Kind, LayoutParams, trailer_count


class LynxCodec(KVCodec):
    name = "lynx"
    progressive = True
    two_streams = True

    def __init__(self, params: LayoutParams | None = None, *, alpha: float = 0.0, **extra: Any) -> None:
        super().__init__(params, **extra)
        if not 0.0 <= float(alpha) <= 1e6:
            raise ValueError(f"alpha: {alpha} is out of range [0, 1e6]")
        self.alpha = float(alpha)

    def _encode_header(self, x: Tensor) -> Tensor:
        return lynx_format.encode_header(x, self.params)

    def _apply_header(self, out: Tensor, header: Tensor) -> None:
        lynx_format.apply_header(out, header)

    def layer_trailer(self, x: Tensor, residual: Tensor) -> Tensor:
        tokens, heads, dim = (int(s) for s in x.shape)
        return lynx_format.trailer_from_residual(residual, tokens, heads, dim, self.params)

    def _anchor_only_residual(self, anchor: Tensor, tokens: int, heads: int, dim: int) -> Tensor | None:
        return lynx_format.anchor_only_residual(anchor, tokens, heads, dim, self.params)

    def encode_trailer(self, x: Tensor, kind: Kind, *, layer: int | None = None) -> Tensor:
        tokens, heads, dim = (int(s) for s in x.shape)
        count = trailer_count(self.name, tokens, self.params)
        if not count:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        page = self.params.page_tokens
        first, full = (tokens - count) // page, tokens // page
        parts = []
        if first < full:
            pages = x[first * page : full * page].float().reshape(full - first, page, heads, dim)
            parts.append(self._encode_pages(pages, kind, first, layer)[1].reshape(-1))
        if tokens % page:
            parts.append(self._encode_pages(x[full * page :].float().unsqueeze(0), kind, full, layer)[1].reshape(-1))
        return lynx_format.trailer_from_residual(torch.cat(parts), tokens, heads, dim, self.params)

    def _encode_pages(self, pages: Tensor, kind: Kind, first_page: int, layer: int | None) -> tuple[Tensor, Tensor]:
        what = f"{self.name} {describe(layer, kind)} pages from {first_page}"
        return lynx_format.encode_pages(pages, kind, first_page, self.params, self.alpha, what)

    def _decode_pages(
        self, anchor: Tensor, residual: Tensor | None, tokens: int, heads: int, dim: int, kind: Kind
    ) -> Tensor:
        return lynx_format.decode_pages(anchor, residual, tokens, heads, dim, kind, self.params, self.alpha)


class LynxInt8Codec(LynxCodec):
    name = "lynx-int8"
    progressive = False


class LynxInt4Codec(LynxCodec):
    name = "lynx-int4"
    progressive = False
    two_streams = False

    def _send_residual(self) -> bool:
        return False


class LynxExactCodec(LynxCodec):
    """``lynx`` plus the lossless third stream: :meth:`encode_exact` / :meth:`decode_exact` (``lynx_exact``)."""

    name = "lynx-exact"
    exact_stream = True

    def __init__(self, params: LayoutParams | None = None, *, alpha: float = 0.0, **extra: Any) -> None:
        super().__init__(params, alpha=alpha, **extra)
        if self.alpha != 0.0:
            raise ValueError(f"alpha: lynx-exact needs alpha 0 (the bins of the linear code), got {self.alpha}")

    def encode_exact(self, x: Tensor, enc: EncodedKV) -> bytes:
        """The exact stream of one layer's BF16 ``x`` against ``enc = self.encode(x, kind)``."""
        return lynx_exact.encode_exact(x, enc, self.params)

    def decode_exact(self, enc: EncodedKV, exact: bytes | bytearray | memoryview) -> Tensor:
        """The original BF16 ``[T, H, D]`` from ``enc`` (anchor + residual) and the exact stream."""
        return lynx_exact.decode_exact(enc, exact, self.params)
