"""The codec interface: ``KVCodec`` encodes one layer's K or V into ``EncodedKV`` and back.

Lifecycle: a codec is built once from its parameters (``registry.get_codec``), is stateless and
thread-safe afterwards, and is called per (layer, kind). ``encode`` validates the input (shape,
dtype, finiteness; errors name the layer and page), cuts it into pages of ``page_tokens`` tokens and
hands batches of equal-sized pages to the scheme's pure ``_encode_pages``; ``decode`` checks the
stream lengths against ``layout.stream_bytes`` and hands the page blocks to ``_decode_pages``.

Invariants:

* ``EncodedKV.anchor`` holds every byte of metadata: it decodes alone (``with_residual=False``).
  It is ``[layer header][page blocks][layer trailer]``; the trailer (``lynx`` only) repeats residual
  bytes of the last tokens, which an anchor-only decode uses (``_anchor_only_residual``).
* ``len(anchor), len(residual) == layout.stream_bytes(name, T, H, D, kind, params)``.
* Streams are page-major (``layout`` module docstring); a page block depends only on that page's
  tokens, its index being 0 or not, and the codec parameters.
* For a one-stream scheme ``with_residual`` is ignored; the anchor is the whole reconstruction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .layout import (
    Kind,
    LayoutParams,
    check_shape,
    header_bytes,
    page_block_bytes,
    page_sizes,
    scheme_layout,
    stream_bytes,
)

ACCEPTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BytesLike = bytes | bytearray | memoryview | Tensor


@dataclass
class EncodedKV:
    """One layer's encoded keys or values."""

    anchor: Tensor  # uint8, 1-D, contiguous; holds all metadata
    residual: Tensor  # uint8, 1-D, contiguous; empty for one-stream schemes
    num_tokens: int
    num_heads: int
    head_dim: int
    kind: Kind
    codec: str


def describe(layer: int | None, kind: str) -> str:
    return f"layer {layer} {kind}" if layer is not None else f"{kind}"


def validate_input(x: Tensor, kind: str, layer: int | None, page_tokens: int, *, values: bool = True) -> None:
    """Shape, dtype and (``values``) finiteness checks shared by every codec (errors name layer and page)."""
    where = describe(layer, kind)
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{where}: expected [num_tokens, num_heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in ACCEPTED_DTYPES:
        raise TypeError(f"{where}: dtype {x.dtype} not supported; use bfloat16, float16 or float32")
    check_shape(int(x.shape[0]), int(x.shape[1]), int(x.shape[2]), kind)
    if not values:
        return
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        token = int((~finite).reshape(x.shape[0], -1).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"{where}: NaN or Inf in page {token // page_tokens} (token {token}); KV caches must be finite"
        )


def to_uint8_tensor(data: BytesLike, what: str) -> Tensor:
    if isinstance(data, Tensor):
        if data.dtype != torch.uint8:
            raise TypeError(f"{what}: expected a uint8 tensor, got {data.dtype}")
        return data.reshape(-1)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    raise TypeError(f"{what}: expected bytes or a uint8 tensor, got {type(data).__name__}")


class KVCodec(ABC):
    """A KV quantization scheme; subclasses implement the two pure page functions."""

    name: str = "abstract"
    progressive: bool = False
    two_streams: bool = False  # True when the scheme has a residual stream

    def __init__(self, params: LayoutParams | None = None, **_: Any) -> None:
        self.params = params or LayoutParams()

    # ----- what subclasses implement -------------------------------------------------------------
    @abstractmethod
    def _encode_pages(self, pages: Tensor, kind: Kind, first_page: int, layer: int | None) -> tuple[Tensor, Tensor]:
        """``[n, t, H, D]`` float32 -> (anchor blocks ``[n, A]``, residual blocks ``[n, R]``) uint8."""

    @abstractmethod
    def _decode_pages(
        self, anchor: Tensor, residual: Tensor | None, tokens: int, heads: int, dim: int, kind: Kind
    ) -> Tensor:
        """Inverse of ``_encode_pages``: ``[n, t, H, D]`` float32 (anchor-only when residual is None)."""

    def _encode_header(self, x: Tensor) -> Tensor:
        """Layer header bytes (exact sink tokens for ``lynx``); empty by default."""
        return torch.empty(0, dtype=torch.uint8, device=x.device)

    def _apply_header(self, out: Tensor, header: Tensor) -> None:
        """Overwrite what the layer header restores exactly (float32 ``out``); nothing by default."""
        return None

    def _send_residual(self) -> bool:
        return self.two_streams

    def layer_trailer(self, x: Tensor, residual: Tensor) -> Tensor:
        """The layer trailer of ``x`` (float32 or the input dtype, ``[T, H, D]``) whose whole residual stream
        is ``residual`` (computed even when it is not sent): what ends the anchor stream (``lynx``: residual
        nibbles; KIVI: bf16 values); empty by default."""
        return residual[:0]

    def _apply_trailer(self, out: Tensor, trailer: Tensor) -> None:
        """Overwrite what the layer trailer restores (float32 ``out``); nothing by default (``lynx``'s
        trailer is read through ``_anchor_only_residual``)."""
        return None

    def _anchor_only_residual(self, anchor: Tensor, tokens: int, heads: int, dim: int) -> Tensor | None:
        """The residual stream an anchor-only decode uses (from the trailer), or None: anchor codes alone."""
        return None

    def encode_trailer(self, x: Tensor, kind: Kind, *, layer: int | None = None) -> Tensor:
        """The layer trailer of a validated ``x`` alone (re-encodes the pages it needs), as in ``encode(x)``."""
        return torch.empty(0, dtype=torch.uint8, device=x.device)

    # ----- the public interface --------------------------------------------------------------------
    def stream_bytes(self, num_tokens: int, num_heads: int, head_dim: int, kind: Kind) -> tuple[int, int]:
        return stream_bytes(self.name, num_tokens, num_heads, head_dim, kind, self.params)

    def encode_header(self, x: Tensor) -> Tensor:
        """The layer header bytes of ``x`` (validated input; empty for most schemes)."""
        return self._encode_header(x.float())

    def encode_page_range(
        self, x: Tensor, kind: Kind, first_page: int, count: int, *, layer: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Blocks of the full pages ``[first_page, first_page + count)`` of a validated ``x``:
        (anchor ``[count, A]``, residual ``[count, R]``), byte-identical to those inside ``encode(x)``."""
        page = self.params.page_tokens
        if first_page < 0 or count < 1 or (first_page + count) * page > x.shape[0]:
            raise ValueError(f"pages [{first_page}, {first_page + count}) are not full pages of {x.shape[0]} tokens")
        pages = x[first_page * page : (first_page + count) * page].float().reshape(count, page, *x.shape[1:])
        anchor, residual = self._encode_pages(pages, kind, first_page, layer)
        if not self._send_residual():
            residual = residual[:, :0]
        return anchor, residual

    def encode(self, x: Tensor, kind: Kind, *, layer: int | None = None) -> EncodedKV:
        page = self.params.page_tokens
        validate_input(x, kind, layer, page)
        tokens, heads, dim = (int(s) for s in x.shape)
        xf = x.float()
        anchors = [self._encode_header(xf)]
        residuals = []
        full = tokens // page
        batches = [(0, full, page)] if full else []
        if tokens % page:
            batches.append((full, 1, tokens % page))
        for first, count, size in batches:
            pages = xf[first * page : first * page + count * size].reshape(count, size, heads, dim)
            anchor, residual = self._encode_pages(pages, kind, first, layer)
            anchors.append(anchor.reshape(-1))
            residuals.append(residual.reshape(-1))
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        residual_full = torch.cat(residuals) if residuals else empty
        anchors.append(self.layer_trailer(xf, residual_full))
        anchor_all = torch.cat(anchors)
        residual_all = residual_full if self._send_residual() else empty
        return EncodedKV(anchor_all, residual_all, tokens, heads, dim, kind, self.name)

    def decode(
        self,
        enc: EncodedKV,
        *,
        with_residual: bool,
        out: Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Tensor:
        tokens, heads, dim, kind = enc.num_tokens, enc.num_heads, enc.head_dim, enc.kind
        want_anchor, want_residual = self.stream_bytes(tokens, heads, dim, kind)
        if enc.anchor.numel() != want_anchor:
            raise ValueError(
                f"{self.name} {kind}: anchor has {enc.anchor.numel()} bytes, expected {want_anchor} "
                f"for [{tokens}, {heads}, {dim}]"
            )
        use_residual = with_residual and self.two_streams and want_residual > 0
        if use_residual and enc.residual.numel() != want_residual:
            raise ValueError(f"{self.name} {kind}: residual has {enc.residual.numel()} bytes, expected {want_residual}")
        residual_stream = enc.residual if use_residual else self._anchor_only_residual(enc.anchor, tokens, heads, dim)
        values_per_token = heads * dim * scheme_layout(self.name).residual_bits // 8
        if out is not None:
            if tuple(out.shape) != (tokens, heads, dim):
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {(tokens, heads, dim)}")
            dtype = out.dtype
        result = torch.empty(tokens, heads, dim, dtype=torch.float32, device=enc.anchor.device)
        page = self.params.page_tokens
        a_off = header_bytes(self.name, tokens, heads, dim, self.params)
        header = enc.anchor[:a_off]
        r_off = 0
        start = 0
        for size in _runs(page_sizes(tokens, page)):
            count, tok = size
            a_bytes = page_block_bytes(self.name, tok, heads, dim, kind, self.params)[0]
            r_bytes = tok * values_per_token
            anchor_blocks = enc.anchor[a_off : a_off + count * a_bytes].view(count, a_bytes)
            residual_blocks = (
                residual_stream[r_off : r_off + count * r_bytes].view(count, r_bytes)
                if residual_stream is not None
                else None
            )
            pages = self._decode_pages(anchor_blocks, residual_blocks, tok, heads, dim, kind)
            result[start : start + count * tok] = pages.reshape(count * tok, heads, dim)
            a_off += count * a_bytes
            r_off += count * r_bytes
            start += count * tok
        self._apply_header(result, header)
        self._apply_trailer(result, enc.anchor[a_off:])
        if out is None:
            return result.to(dtype)
        out.copy_(result)
        return out

    def decode_from_bytes(
        self,
        anchor_bytes: BytesLike,
        residual_bytes: BytesLike | None,
        num_tokens: int,
        num_heads: int,
        head_dim: int,
        kind: Kind,
        *,
        out: Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Tensor:
        """Decode raw buffers from the transport; lengths are checked against the layout table."""
        want_anchor, want_residual = self.stream_bytes(num_tokens, num_heads, head_dim, kind)
        anchor = to_uint8_tensor(anchor_bytes, "anchor")
        if anchor.numel() != want_anchor:
            raise ValueError(
                f"{self.name} {kind}: got {anchor.numel()} anchor bytes, expected {want_anchor} for "
                f"[{num_tokens}, {num_heads}, {head_dim}]"
            )
        residual = torch.empty(0, dtype=torch.uint8)
        if residual_bytes is not None:
            residual = to_uint8_tensor(residual_bytes, "residual")
            if residual.numel() != want_residual:
                raise ValueError(f"{self.name} {kind}: got {residual.numel()} residual bytes, expected {want_residual}")
        enc = EncodedKV(anchor, residual, num_tokens, num_heads, head_dim, kind, self.name)
        return self.decode(enc, with_residual=residual_bytes is not None, out=out, dtype=dtype)


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """Collapse page sizes into (count, tokens) runs: full pages, then the partial page."""
    runs: list[tuple[int, int]] = []
    for size in sizes:
        if runs and runs[-1][1] == size:
            runs[-1] = (runs[-1][0] + 1, size)
        else:
            runs.append((1, size))
    return runs
