"""Radix-cache-aware page encoding: encoded pages of a shared prefix are reused, not re-encoded.

A page's encoded blocks depend only on its tokens' KV, which (causal model) depend only on the token
ids up to the end of that page. So a full page is keyed by ``PageKey(prefix_hash, page_index, layer,
kind, codec_key)`` where ``prefix_hash`` hashes every token id from the start of the request to the
end of the page (chained per page, ``prefix_page_hashes``). The partial last page is never cached
(the next request's page will hold more tokens).

Lifecycle: the prefill side owns one ``EncodedPageCache`` (bounded by ``max_bytes``, LRU). For each
layer it calls ``encode_with_cache``: hits are copied from the cache, misses are encoded in runs and
inserted. When SGLang's radix cache evicts a node, the integration calls ``invalidate(prefix_hash)``
for the evicted pages' hashes (or ``invalidate_all``), so a page can never be served after its KV
left the radix cache. State: just the ``OrderedDict``; not thread-safe (one owner thread).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import EncodedKV, KVCodec, validate_input
from .layout import Kind


@dataclass(frozen=True)
class PageKey:
    prefix_hash: str
    page_index: int
    layer: int
    kind: str
    codec_key: str


def codec_key(codec: KVCodec) -> str:
    """Everything that changes a page's bytes: codec name, layout parameters, alpha."""
    return f"{codec.name}|{codec.params}|alpha={getattr(codec, 'alpha', None)}"


def prefix_page_hashes(token_ids: Sequence[int], page_tokens: int) -> list[str]:
    """Chained hash of the token ids through the end of each *full* page."""
    hashes = []
    running = hashlib.blake2b(digest_size=16)
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        page = token_ids[start : start + page_tokens]
        running.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in page))
        hashes.append(running.copy().hexdigest())
    return hashes


class EncodedPageCache:
    """LRU cache of encoded page blocks, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PageKey, tuple[Tensor, Tensor]] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PageKey) -> tuple[Tensor, Tensor] | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: PageKey, anchor: Tensor, residual: Tensor) -> None:
        size = anchor.numel() + residual.numel()
        if size > self.max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (anchor.clone(), residual.clone())
        self.bytes_used += size
        while self.bytes_used > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1

    def invalidate(self, prefix_hash: str) -> int:
        """Drop every entry of the page whose prefix hash is given (all layers, kinds, codecs)."""
        doomed = [key for key in self._entries if key.prefix_hash == prefix_hash]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def invalidate_all(self) -> None:
        self._entries.clear()
        self.bytes_used = 0

    def _drop(self, key: PageKey) -> None:
        anchor, residual = self._entries.pop(key)
        self.bytes_used -= anchor.numel() + residual.numel()


def encode_with_cache(
    codec: KVCodec,
    x: Tensor,
    kind: Kind,
    layer: int,
    page_hashes: Sequence[str],
    cache: EncodedPageCache,
) -> EncodedKV:
    """``codec.encode(x, kind)`` with full pages served from / stored into ``cache``; byte-identical."""
    page = codec.params.page_tokens
    validate_input(x, kind, layer, page)
    tokens, heads, dim = (int(s) for s in x.shape)
    full = tokens // page
    if len(page_hashes) < full:
        raise ValueError(f"need {full} page hashes for {tokens} tokens, got {len(page_hashes)}")
    ckey = codec_key(codec)
    blocks: list[tuple[Tensor, Tensor] | None] = [
        cache.get(PageKey(page_hashes[p], p, layer, kind, ckey)) for p in range(full)
    ]
    p = 0
    while p < full:
        if blocks[p] is not None:
            p += 1
            continue
        end = p
        while end < full and blocks[end] is None:
            end += 1
        anchor, residual = codec.encode_page_range(x, kind, p, end - p, layer=layer)
        for i in range(p, end):
            blocks[i] = (anchor[i - p], residual[i - p])
            cache.put(PageKey(page_hashes[i], i, layer, kind, ckey), anchor[i - p], residual[i - p])
        p = end
    anchors = [codec.encode_header(x)] + [b[0] for b in blocks if b is not None]
    residuals = [b[1] for b in blocks if b is not None]
    if tokens % page:
        tail = codec.encode(x[full * page :], kind, layer=layer) if full == 0 else None
        if tail is not None:  # a single partial page is the whole request: encode() does it all
            return tail
        pages = x[full * page :].float().unsqueeze(0)
        anchor, residual = codec._encode_pages(pages, kind, full, layer)
        anchors.append(anchor[0])
        residuals.append(residual[0] if codec.two_streams else residual[0, :0])
    anchors.append(codec.encode_trailer(x, kind, layer=layer))
    empty = torch.empty(0, dtype=torch.uint8, device=x.device)
    residual_all = torch.cat(residuals) if residuals and codec.two_streams else empty
    return EncodedKV(torch.cat(anchors), residual_all, tokens, heads, dim, kind, codec.name)
