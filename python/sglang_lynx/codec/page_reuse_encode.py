"""Encoding through the encoded-page cache (``page_cache``): byte-identical to encoding from scratch.

``encode_streams_with_cache(encoder, streams, page_hashes, cache, ...)`` encodes the layer streams of
one request (``streams[i] = (kind, layer, x[T, H, D])``, one shape) straight into the request's two
byte streams (``request``: the streams' anchors back to back, then their residuals) and returns them.
Full page ``p`` is looked up once for all streams (``PageKey(page_hashes[p], p, codec_key, streams)``);
per stream, a hit page's blocks are copied out of its entry, and each run of missing pages is encoded
in one call of ``PageEncoder.blocks_into``, which writes them at their place in the stream (the C
page-range API, or the reference's page function and a copy). The header is written from ``x``'s
sink tokens, the trailer from the residual as computed (a scratch stream for an anchor-only codec,
which does not send it). The missing full pages are stored afterwards, one entry per page, backed by
the request's own streams (no copy: the caller only reads what it is given). Copies are the cost
that matters: on the CPU the C codec encodes only a few times slower than memcpy.

A ``PageEncoder`` that ``checks_values`` rejects NaN / Inf itself; otherwise every layer is checked
here. A hit page needs no check: it is the very KV that was checked when it was encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from .base import EncodedKV, KVCodec, validate_input
from .layout import ALIASES, Kind, header_bytes, page_block_bytes, page_sizes, stream_bytes, trailer_bytes
from .page_cache import EncodedPageCache, PageEntry, PageKey, codec_key

Block = tuple[Tensor, Tensor]  # (anchor block, residual block as computed: also for anchor-only codecs)
Stream = tuple[Kind, int, Tensor]  # (kind, layer, x)


class PageEncoder(Protocol):
    """Encodes pages of one validated layer ``x[T, H, D]`` exactly as ``codec.encode`` would."""

    codec: KVCodec
    checks_values: bool  # True: the encoder itself rejects NaN / Inf (naming layer and page)

    def blocks_into(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None,
                    anchor: Tensor, residual: Tensor) -> None:
        """Write pages ``[first_page, first_page + count)`` (the last may be partial) at their offsets
        in the layer's streams ``anchor`` / ``residual`` (uint8, whole-layer sized; the residual as
        computed)."""
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

    def blocks_into(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None,
                    anchor: Tensor, residual: Tensor) -> None:
        tokens, heads, dim = (int(s) for s in x.shape)
        spans = block_spans(self.codec, tokens, heads, dim, kind)
        for p, (a, r) in enumerate(self.blocks(x, kind, first_page, count, layer), start=first_page):
            (a0, a1), (r0, r1) = spans[p]
            anchor[a0:a1].copy_(a.reshape(-1))
            residual[r0:r1].copy_(r.reshape(-1))


Span = tuple[tuple[int, int], tuple[int, int]]  # ((anchor start, end), (residual start, end))


def block_spans(codec: KVCodec, tokens: int, heads: int, dim: int, kind: Kind) -> list[Span]:
    """``[((anchor start, end), (residual start, end)) of page p]`` inside one layer's streams (the
    residual as computed: ``lynx``'s sizes for an anchor-only alias)."""
    name, params = _computed_name(codec), codec.params
    a_at, r_at = header_bytes(name, tokens, heads, dim, params), 0
    spans: list[Span] = []
    for size in page_sizes(tokens, params.page_tokens):
        a, r = page_block_bytes(name, size, heads, dim, kind, params)
        spans.append(((a_at, a_at + a), (r_at, r_at + r)))
        a_at, r_at = a_at + a, r_at + r
    return spans


def check_page_range(tokens: int, page_tokens: int, first_page: int, count: int,
                     buffers: Sequence[tuple[str, Tensor, int]]) -> None:
    """The arguments of a kernel's page-range encode (``encode_pages_into``): ``[first_page, first_page +
    count)`` are pages of ``tokens`` tokens, and each ``(name, buffer, bytes needed)`` is a contiguous uint8
    buffer of at least that many bytes."""
    if first_page < 0 or count < 1 or first_page + count > len(page_sizes(tokens, page_tokens)):
        raise ValueError(f"pages [{first_page}, {first_page + count}) are not pages of {tokens} tokens")
    for name, buf, need in buffers:
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.numel() < need:
            raise ValueError(f"{name}: expected a contiguous uint8 buffer of >= {need} bytes, got "
                             f"{buf.dtype} x {buf.numel()}")


def _computed_name(codec: KVCodec) -> str:
    """The layout row whose residual is what the codec computes (an anchor-only alias computes its base's)."""
    return ALIASES[codec.name][0] if codec.name in ALIASES else codec.name


def encode_streams_with_cache(
    coder: KVCodec | PageEncoder,
    streams: Sequence[Stream],
    page_hashes: Sequence[str],
    cache: EncodedPageCache,
    slot_hashes: Sequence[str] | None = None,
    epoch: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The request's (anchor, residual) streams: ``codec.encode(x, kind)`` of every stream in order, their
    anchors back to back then their residuals, byte-identical, with full pages served from / stored into
    ``cache``. ``page_hashes[p]`` keys full page ``p``; ``slot_hashes[p]``, when given, must match the
    entry's too; ``epoch``: see ``EncodedPageCache.put``. Pages without a hash are encoded."""
    encoder: PageEncoder = ReferencePageEncoder(coder) if isinstance(coder, KVCodec) else coder
    base, page = encoder.codec, encoder.codec.params.page_tokens
    for kind, layer, x in streams:
        validate_input(x, kind, layer, page, values=not encoder.checks_values)
    shapes = sorted({tuple(x.shape) for _, _, x in streams})
    if len(shapes) != 1:
        raise ValueError(f"the streams of one request must share one shape, got {shapes}")
    tokens, heads, dim = (int(s) for s in streams[0][2].shape)
    device = streams[0][2].device
    count = len(page_sizes(tokens, page))
    cacheable = min(tokens // page, len(page_hashes), len(slot_hashes) if slot_hashes is not None else tokens)
    names = tuple((kind, layer) for kind, layer, _ in streams)
    ckey = codec_key(base)

    def key(p: int) -> PageKey:
        return PageKey(page_hashes[p], p, ckey, names)

    def digest(p: int) -> str | None:
        return slot_hashes[p] if slot_hashes is not None else None

    found = [cache.get(key(p), digest(p)) for p in range(cacheable)] + [None] * (count - cacheable)
    sizes = [stream_bytes(_computed_name(base), tokens, heads, dim, kind, base.params) for kind, _, _ in streams]
    sends = base._send_residual()
    anchor_all = torch.empty(sum(a for a, _ in sizes), dtype=torch.uint8, device=device)
    computed_all = torch.empty(sum(r for _, r in sizes), dtype=torch.uint8, device=device)
    spans = {kind: block_spans(base, tokens, heads, dim, kind) for kind in {k for k, _, _ in streams}}
    hdr = header_bytes(base.name, tokens, heads, dim, base.params)
    trailer = trailer_bytes(base.name, tokens, heads, dim, base.params)
    fresh: list[list[Span]] = [[] for _ in range(cacheable)]  # missing full pages: each stream's spans
    a_at = r_at = 0
    for i, (kind, layer, x) in enumerate(streams):
        base_a, base_r = a_at, r_at
        anchor, computed = anchor_all[a_at : a_at + sizes[i][0]], computed_all[r_at : r_at + sizes[i][1]]
        a_at, r_at = a_at + sizes[i][0], r_at + sizes[i][1]
        if hdr:
            anchor[:hdr].copy_(base.encode_header(x[:page]))  # the sink tokens
        p = 0
        while p < count:
            entry = found[p]
            if entry is not None:
                (a0, a1), (r0, r1) = spans[kind][p]
                block = entry.block(i)
                anchor[a0:a1].copy_(block[0])
                computed[r0:r1].copy_(block[1])
                p += 1
                continue
            end = p + 1
            while end < count and found[end] is None:
                end += 1
            encoder.blocks_into(x, kind, p, end - p, layer, anchor, computed)
            for q in range(p, min(end, cacheable)):
                (a0, a1), (r0, r1) = spans[kind][q]
                fresh[q].append(((base_a + a0, base_a + a1), (base_r + r0, base_r + r1)))
            p = end
        if trailer:  # lynx: the last tokens' residual nibbles; KIVI: their bf16 values
            anchor[anchor.numel() - trailer :].copy_(base.layer_trailer(x, computed))
    for p, stream_spans in enumerate(fresh):  # the request's own streams back its new entries (no copy)
        if stream_spans:
            entry = PageEntry(anchor_all, computed_all, tuple(a for a, _ in stream_spans),
                              tuple(r for _, r in stream_spans))
            cache.put(key(p), entry, digest(p), epoch)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    return anchor_all, computed_all if sends else empty


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
    """One layer stream: ``encode_streams_with_cache`` of ``[(kind, layer, x)]``, as an ``EncodedKV``."""
    anchor, residual = encode_streams_with_cache(coder, [(kind, layer, x)], page_hashes, cache, slot_hashes, epoch)
    base = coder if isinstance(coder, KVCodec) else coder.codec
    tokens, heads, dim = (int(s) for s in x.shape)
    return EncodedKV(anchor, residual, tokens, heads, dim, kind, base.name)
