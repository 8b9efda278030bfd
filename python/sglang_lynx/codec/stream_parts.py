"""A request's streams encoded in parts, page range by page range, as its prefill chunks arrive.

Every stream is page-major (``layout``): a layer's anchor is ``[header][page blocks][trailer]`` and
its residual the page blocks' nibbles, so the bytes of codec pages ``[first, end)`` of every layer sit
at fixed offsets that follow from the request's shape alone. A :class:`PartEncoder` for one request
writes, for each part, exactly those bytes into the request's whole-size buffers (the send region's
anchor, a private scratch for the residual as computed, the send region's residual *body*
(``wire_residual``)) and returns the byte spans it wrote, which are what the transport sends for the
part. The first part also writes each layer's header (the sink tokens); the part that takes a layer to its
end (the partial last page included) writes that layer's trailer too (computed from the residual scratch,
which holds every page of the layer by then): the last part, or a layer group's part through the last page
(a prefill whose forward computed the request's last token). A part may cover only some layers (``layers``:
a layer group whose KV the prefill has just written); pages then go in order per layer, and the last part
(every layer) completes each layer that no group's part completed, from its own next page.

Invariant (tested on random KV for every codec and many split points): once parts covering pages
``[0, n)`` with the last flagged ``last`` have been encoded, the anchor buffer equals
``encode_request(...).anchor`` byte for byte and the body equals ``residual_to_wire`` of its residual;
the spans of all parts are disjoint and cover both streams exactly. So the decode side sees the very
bytes of a whole-request encode, whatever the split.

Pure transform over caller-owned tensors: no threads, no transport (``integration/transport`` drives it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import KVCodec, validate_input
from .layout import Kind, header_bytes, page_sizes, stream_bytes, trailer_bytes
from .page_reuse_encode import PageEncoder, ReferencePageEncoder, _computed_name, block_spans
from .request import request_spans
from .wire_residual import residual_tail_bytes

Span = tuple[int, int]  # (offset, length) in a request stream


@dataclass(frozen=True)
class _LayerStream:
    kind: Kind
    layer: int
    anchor_at: int  # offset of the layer's anchor in the request's anchor stream
    anchor_len: int
    computed_at: int  # ... of its residual as computed, in the scratch
    computed_len: int
    body_at: int  # ... of its residual body in the wire residual (0-length when not sent)
    body_len: int


def _merge(spans: list[Span]) -> list[Span]:
    """Adjacent spans joined, empty ones dropped (spans come in increasing order)."""
    out: list[Span] = []
    for at, n in spans:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((at, n))
    return out


class PartEncoder:
    """Encodes one request's layers ``[T, H, D]`` (K and V of ``num_layers`` layers) in page-range parts."""

    def __init__(self, coder: KVCodec | PageEncoder, num_layers: int, tokens: int, heads: int, dim: int) -> None:
        self.encoder: PageEncoder = ReferencePageEncoder(coder) if isinstance(coder, KVCodec) else coder
        base = self.encoder.codec
        self.codec, self.tokens, self.heads, self.dim = base, tokens, heads, dim
        self.page = base.params.page_tokens
        self.pages = len(page_sizes(tokens, self.page))
        name = _computed_name(base)
        self._header = header_bytes(base.name, tokens, heads, dim, base.params)
        self._trailer = trailer_bytes(base.name, tokens, heads, dim, base.params)
        self._spans = {kind: block_spans(base, tokens, heads, dim, kind) for kind in ("k", "v")}
        sends = base.two_streams and base._send_residual()
        tail = residual_tail_bytes(base, tokens, heads, dim) if sends else 0
        layers, computed_at, body_at = [], 0, 0
        for span in request_spans(base, num_layers, tokens, heads, dim):
            computed_len = stream_bytes(name, tokens, heads, dim, span.kind, base.params)[1]
            body_len = span.residual_bytes - tail if sends else 0
            layers.append(_LayerStream(span.kind, span.layer, span.anchor_offset, span.anchor_bytes, computed_at,
                                       computed_len, body_at, body_len))
            computed_at, body_at = computed_at + computed_len, body_at + body_len
        self.layers = layers
        self.anchor_bytes = layers[-1].anchor_at + layers[-1].anchor_len
        self.computed_bytes, self.body_bytes = computed_at, body_at
        self.num_layers = num_layers
        # per layer: parts come in page order, each starting where the layer's last one ended
        self.next_pages = [0] * num_layers
        self.completed = [False] * num_layers  # the layer's last page and trailer are encoded
        self.done = False

    @property
    def next_page(self) -> int:
        """The first page not encoded yet in every layer."""
        return min(self.next_pages)

    def encodable_pages(self, tokens_received: int) -> int:
        """Pages whose tokens have all arrived (the partial last page only with the whole request)."""
        return self.pages if tokens_received >= self.tokens else tokens_received // self.page

    def runs(self, end_page: int, last: bool, layers: range | None = None) -> list[tuple[int, int, int]]:
        """(layer, first page, end page) of each layer the next :meth:`encode_part` call with these arguments
        encodes pages of (``exact_request``'s page runs; a run may be empty)."""
        every = layers is None or last
        return [(i, self.next_pages[i], self.pages if last else end_page)
                for i in (range(self.num_layers) if every else layers)  # type: ignore[union-attr]
                if not self.completed[i]]

    def new_scratch(self, device: torch.device | str = "cpu") -> Tensor:
        """The residual-as-computed scratch a request's parts share (uint8, whole-request sized)."""
        return torch.empty(self.computed_bytes, dtype=torch.uint8, device=device)

    def encode_part(self, k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], end_page: int, last: bool,
                    anchor: Tensor, computed: Tensor, body: Tensor | None,
                    layers: range | None = None) -> tuple[list[Span], list[Span]]:
        """Encode pages ``[next page, end_page)`` of every layer in ``layers`` (None: all; ``last``: every
        layer not completed yet through the end, with the trailers; ``end_page`` = the request's page
        count: those layers through the end, with their trailers) into ``anchor`` / ``computed`` / ``body`` (uint8,
        ``anchor_bytes`` / ``computed_bytes`` / ``body_bytes`` long; ``body`` None when no residual is
        sent). ``k_layers[i]`` / ``v_layers[i]`` are ``[T, H, D]`` with at least the rows of those pages
        filled. The layers of one part share their next page. Returns the (anchor, body) spans written."""
        if self.done:
            raise ValueError("the request's last part was already encoded")
        if layers is None or last:
            layers = range(self.num_layers)
        if not layers or layers.step != 1 or layers.start < 0 or layers.stop > self.num_layers:
            raise ValueError(f"layers {layers} of a {self.num_layers}-layer request")
        if not last and any(self.completed[i] for i in layers):
            raise ValueError(f"layers {layers} were already encoded through the last page")
        starts = {self.next_pages[i] for i in layers} if not last else {0}
        if len(starts) != 1:
            raise ValueError(f"layers {layers} are at different pages {sorted(starts)}: not one part")
        first_page = self.next_pages[layers.start]
        if last:
            end_page = self.pages
        completes = end_page == self.pages  # the part takes its layers to the end: trailers too
        if not max(self.next_pages[i] for i in layers) <= end_page <= self.pages \
                or (end_page == first_page and not last):
            raise ValueError(f"part of pages [{first_page}, {end_page}) of a {self.pages}-page request")
        if len(k_layers) != len(v_layers) or 2 * len(k_layers) != len(self.layers):
            raise ValueError(f"need {len(self.layers) // 2} K and V layers, got {len(k_layers)} and {len(v_layers)}")
        for name, out, size in (("anchor", anchor, self.anchor_bytes), ("computed", computed, self.computed_bytes),
                                ("body", body, self.body_bytes)):
            if (out is None and name == "body" and size == 0) or (out is not None and out.numel() == size):
                continue
            raise ValueError(f"{name} buffer of {None if out is None else out.numel()} bytes, expected {size}")
        end_token = min(end_page * self.page, self.tokens)
        anchor_spans: list[Span] = []
        body_spans: list[Span] = []
        for stream in self.layers:
            if stream.layer not in layers or self.completed[stream.layer]:
                continue
            first_page = self.next_pages[stream.layer]
            x = (k_layers if stream.kind == "k" else v_layers)[stream.layer]
            if tuple(x.shape) != (self.tokens, self.heads, self.dim):
                raise ValueError(f"layer {stream.layer} {stream.kind}: shape {tuple(x.shape)}, expected "
                                 f"{(self.tokens, self.heads, self.dim)}")
            validate_input(x[first_page * self.page : end_token] if end_token > first_page * self.page else x[:1],
                           stream.kind, stream.layer, self.page, values=not self.encoder.checks_values)
            a = anchor[stream.anchor_at : stream.anchor_at + stream.anchor_len]
            r = computed[stream.computed_at : stream.computed_at + stream.computed_len]
            if first_page == 0 and self._header:
                a[: self._header].copy_(self.codec.encode_header(x[: self.page]))
            if end_page > first_page:
                self.encoder.blocks_into(x, stream.kind, first_page, end_page - first_page, stream.layer, a, r)
            if completes and self._trailer:
                a[a.numel() - self._trailer :].copy_(self.codec.layer_trailer(x, r))
            spans = self._spans[stream.kind]
            at = spans[first_page]  # a layer at its last page was completed with it, and is skipped above
            a0 = 0 if first_page == 0 else at[0][0]
            a1 = stream.anchor_len if completes else spans[end_page - 1][0][1]
            anchor_spans.append((stream.anchor_at + a0, a1 - a0))
            if body is not None and stream.body_len:
                r0 = 0 if first_page == 0 else min(at[1][0], stream.body_len)
                r1 = stream.body_len if completes else min(spans[end_page - 1][1][1], stream.body_len)
                if r1 > r0:
                    body[stream.body_at + r0 : stream.body_at + r1].copy_(r[r0:r1])
                    body_spans.append((stream.body_at + r0, r1 - r0))
        for i in layers:
            self.next_pages[i] = end_page
            self.completed[i] = self.completed[i] or completes
        self.done = last
        return _merge(anchor_spans), _merge(body_spans)
