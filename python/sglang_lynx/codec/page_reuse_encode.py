"""Encoding through the encoded-page cache (``page_cache``): byte-identical to encoding from scratch.

``encode_streams_with_cache(encoder, streams, page_hashes, cache, ...)`` encodes several layer streams
of one request (``streams[i] = (kind, layer, x[T, H, D])``, all the same shape) and returns each one's
``EncodedKV``, equal to ``codec.encode(x, kind)``. Full page ``p`` is looked up once for all streams
(``PageKey(page_hashes[p], p, codec_key, streams)``):

- no page found: every stream is encoded in one pass (``PageEncoder.encode``) and each full page's
  blocks are cut out of the streams (``layout``: header, page blocks, trailer) into one entry per page;
  an anchor-only codec with a trailer does not keep its residual in the stream, so it takes the
  page-block path below instead;
- some found: per stream, hit pages are copied from their entries and each run of missing pages is
  encoded in one call (``PageEncoder.blocks``, the C page-range API or the reference's page function);
  the layer header is re-cut from ``x``, the trailer from the stitched residual as computed; the
  missing full pages are then stored.

A ``PageEncoder`` that ``checks_values`` rejects NaN / Inf itself; otherwise every layer is checked
here. A hit page needs no check: it is the very KV that was checked when it was encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from .base import EncodedKV, KVCodec, validate_input
from .layout import Kind, header_bytes, page_block_bytes, page_sizes, trailer_bytes
from .page_cache import EncodedPageCache, PageEntry, PageKey, codec_key

Block = tuple[Tensor, Tensor]  # (anchor block, residual block as computed: also for anchor-only codecs)
Stream = tuple[Kind, int, Tensor]  # (kind, layer, x)


class PageEncoder(Protocol):
    """Encodes one validated layer ``x[T, H, D]`` exactly as ``codec.encode`` would."""

    codec: KVCodec
    checks_values: bool  # True: the encoder itself rejects NaN / Inf (naming layer and page)

    def blocks(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None) -> list[Block]:
        """Blocks of pages ``[first_page, first_page + count)`` (the last one may be partial)."""
        ...

    def encode(self, x: Tensor, kind: Kind, layer: int | None) -> EncodedKV:
        """``codec.encode(x, kind)`` in one pass."""
        ...


class ReferencePageEncoder:
    """The torch reference, page by page."""

    checks_values = False

    def __init__(self, codec: KVCodec) -> None:
        self.codec = codec

    def blocks(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None) -> list[Block]:
        page = self.codec.params.page_tokens
        tokens, heads, dim = (int(s) for s in x.shape)
        sizes = page_sizes(tokens, page)[first_page : first_page + count]
        full = sum(1 for s in sizes if s == page)
        out: list[Block] = []
        for first, n, size in ((first_page, full, page), (first_page + full, len(sizes) - full, tokens % page)):
            if n:
                pages = x[first * page : first * page + n * size].float().reshape(n, size, heads, dim)
                anchor, residual = self.codec._encode_pages(pages, kind, first, layer)
                out.extend((anchor[i], residual[i]) for i in range(n))
        return out

    def encode(self, x: Tensor, kind: Kind, layer: int | None) -> EncodedKV:
        return self.codec.encode(x, kind, layer=layer)


def _cut_blocks(enc: EncodedKV, codec: KVCodec, page: int) -> Block:
    """Full page ``page``'s blocks inside ``enc``'s streams (views; ``layout``: page-major)."""
    params = codec.params
    a_page, r_page = page_block_bytes(codec.name, params.page_tokens, enc.num_heads, enc.head_dim, enc.kind, params)
    at = header_bytes(codec.name, enc.num_tokens, enc.num_heads, enc.head_dim, params) + page * a_page
    return enc.anchor[at : at + a_page], enc.residual[page * r_page : (page + 1) * r_page]


def encode_streams_with_cache(
    coder: KVCodec | PageEncoder,
    streams: Sequence[Stream],
    page_hashes: Sequence[str],
    cache: EncodedPageCache,
    slot_hashes: Sequence[str] | None = None,
    epoch: int | None = None,
) -> list[EncodedKV]:
    """``[codec.encode(x, kind) for kind, layer, x in streams]``, byte-identical, full pages served from /
    stored into ``cache``. ``page_hashes[p]`` keys full page ``p``; ``slot_hashes[p]``, when given, must
    match the entry's too; ``epoch``: see ``EncodedPageCache.put``. Pages without a hash are encoded."""
    encoder: PageEncoder = ReferencePageEncoder(coder) if isinstance(coder, KVCodec) else coder
    base, page = encoder.codec, encoder.codec.params.page_tokens
    for kind, layer, x in streams:
        validate_input(x, kind, layer, page, values=not encoder.checks_values)
    shapes = sorted({tuple(x.shape) for _, _, x in streams})
    if len(shapes) != 1:
        raise ValueError(f"the streams of one request must share one shape, got {shapes}")
    tokens, heads, dim = (int(s) for s in streams[0][2].shape)
    count = len(page_sizes(tokens, page))
    cacheable = min(tokens // page, len(page_hashes), len(slot_hashes) if slot_hashes is not None else tokens)
    names = tuple((kind, layer) for kind, layer, _ in streams)
    ckey = codec_key(base)

    def key(p: int) -> PageKey:
        return PageKey(page_hashes[p], p, ckey, names)

    def digest(p: int) -> str | None:
        return slot_hashes[p] if slot_hashes is not None else None

    found = [cache.get(key(p), digest(p)) for p in range(cacheable)]
    keeps_residual = base._send_residual() or not trailer_bytes(base.name, tokens, heads, dim, base.params)
    if not any(e is not None for e in found) and keeps_residual:
        encoded = [encoder.encode(x, kind, layer) for kind, layer, x in streams]
        for p in range(cacheable):
            cache.put(key(p), PageEntry.of([_cut_blocks(enc, base, p) for enc in encoded]), digest(p), epoch)
        return encoded

    fresh: list[list[Block]] = [[] for _ in range(cacheable)]  # missing full pages' blocks, per stream
    empty = torch.empty(0, dtype=torch.uint8, device=streams[0][2].device)
    out = []
    for i, (kind, layer, x) in enumerate(streams):
        anchors, residuals, p = [base.encode_header(x[:page])], [], 0  # the header: the sink tokens only
        while p < count:
            entry = found[p] if p < cacheable else None
            if entry is not None:
                blocks, p = [entry.block(i)], p + 1
            else:
                end = p
                while end < count and (end >= cacheable or found[end] is None):
                    end += 1
                blocks = encoder.blocks(x, kind, p, end - p, layer)
                for q, block in enumerate(blocks[: max(0, cacheable - p)], start=p):
                    fresh[q].append(block)
                p = end
            anchors += [a.reshape(-1) for a, _ in blocks]
            residuals += [r.reshape(-1) for _, r in blocks]
        computed = torch.cat(residuals) if residuals else empty
        anchors.append(base._trailer_from_residual(computed, tokens, heads, dim))
        out.append(EncodedKV(torch.cat(anchors), computed if base._send_residual() else empty, tokens, heads, dim,
                             kind, base.name))
    for p, blocks in enumerate(fresh):
        if blocks:
            cache.put(key(p), PageEntry.of(blocks), digest(p), epoch)
    return out


def encode_with_cache(
    coder: KVCodec | PageEncoder,
    x: Tensor,
    kind: Kind,
    layer: int,
    page_hashes: Sequence[str],
    cache: EncodedPageCache,
    slot_hashes: Sequence[str] | None = None,
    epoch: int | None = None,
) -> EncodedKV:
    """One layer stream: ``encode_streams_with_cache`` of ``[(kind, layer, x)]``."""
    return encode_streams_with_cache(coder, [(kind, layer, x)], page_hashes, cache, slot_hashes, epoch)[0]
