"""Radix-cache-aware page encoding: encoded pages of a shared prefix are reused, not re-encoded.

Every stream is page-major (``layout``): a page's block depends on that page's KV only (and on its
index: page 0 holds the sink tokens). In a causal model a page's KV is fixed by the token ids up to
the end of that page, so a full page is keyed by ``PageKey(prefix_hash, page_index, layer, kind,
codec_key)``, where ``prefix_hash`` chains every token id from the start of the request to the end of
the page (``prefix_page_hashes``). The partial last page is never cached (the next request's page
holds more tokens).

Token ids alone do not make two KV pages equal: a prefix computed twice (two requests racing before
the first reached the radix cache, another LoRA namespace) can differ in its last bits. So each entry
also records a *slot digest*: a hash of the KV-pool slots the page was read from. SGLang's radix
cache hands a later request the very slots of the cached prefix, and a slot's KV is never rewritten
while it is allocated; an entry is served only when the new request's page sits in the same slots
(``get`` counts a different digest as ``stale`` and drops the entry). When the radix cache evicts a
node its slots are freed and may be reused: the integration then calls ``invalidate`` for the pages
that end inside the evicted node (``invalidate_all`` when the tree is reset), so an entry can never
outlive the KV it was encoded from. An encode that read its KV before such an invalidation must not
insert afterwards: the caller takes ``epoch()`` while it still owns the slots and passes it to ``put``,
which refuses a page invalidated (or a cache cleared) since.

Lifecycle: the prefill side owns one ``EncodedPageCache`` (bounded by ``max_bytes``, LRU; thread-safe:
the encode thread reads and fills it while the scheduler thread invalidates). For each layer and kind
it calls ``encode_with_cache``: hit pages are copied out of the cache, runs of missing pages are
encoded by a ``PageEncoder`` (the torch reference, or the CPU fast path) and inserted; the result is
byte-identical to ``codec.encode(x, kind)``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from .base import EncodedKV, KVCodec, validate_input
from .layout import Kind, header_bytes, page_block_bytes, page_sizes, trailer_bytes

MAX_INVALIDATION_RECORDS = 1 << 16
Block = tuple[Tensor, Tensor]  # (anchor block, residual block as computed: also for anchor-only codecs)


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
    ids = np.asarray(token_ids, dtype="<i8")
    running = hashlib.blake2b(digest_size=16)
    for start in range(0, len(ids) - page_tokens + 1, page_tokens):
        running.update(ids[start : start + page_tokens].tobytes())
        hashes.append(running.copy().hexdigest())
    return hashes


def slot_digests(slots: Tensor, page_tokens: int) -> list[str]:
    """Hash of each full page's KV-pool slot indices (``slots``: int64, one per token)."""
    flat = slots.to(torch.int64).contiguous().numpy()
    full = len(flat) // page_tokens
    return [hashlib.blake2b(flat[p * page_tokens : (p + 1) * page_tokens].tobytes(), digest_size=16).hexdigest()
            for p in range(full)]


class EncodedPageCache:
    """LRU cache of encoded page blocks, bounded in bytes, safe to share between threads."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PageKey, tuple[Tensor, Tensor, str | None]] = OrderedDict()
        self._by_prefix: dict[str, set[PageKey]] = {}
        self._lock = threading.Lock()
        self._epoch = 0  # +1 per invalidation
        self._invalidated_at: OrderedDict[str, int] = OrderedDict()  # prefix hash -> epoch (bounded)
        self._floor = 0  # puts from before this epoch are refused (cleared, or the record above overflowed)
        self.bytes_used = 0
        self.hits = self.misses = self.stale = self.evictions = self.invalidated = self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PageKey, slot_digest: str | None = None) -> Block | None:
        """The blocks stored under ``key``, if they were encoded from the same slots (None: a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[2] != slot_digest:
                self._drop(key)
                self.stale += 1
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0], entry[1]

    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def put(self, key: PageKey, anchor: Tensor, residual: Tensor, slot_digest: str | None = None,
            epoch: int | None = None) -> None:
        """Store a copy of a page's blocks (a view would keep its whole stream alive, uncounted); with
        ``epoch`` (taken when its KV was read), refused if that page was invalidated since."""
        size = anchor.numel() + residual.numel()
        if size > self.max_bytes:
            return
        entry = (anchor.clone(), residual.clone(), slot_digest)
        with self._lock:
            if epoch is not None and (epoch < self._floor or self._invalidated_at.get(key.prefix_hash, -1) >= epoch):
                self.refused += 1
                return
            if key in self._entries:
                self._drop(key)
            self._entries[key] = entry
            self._by_prefix.setdefault(key.prefix_hash, set()).add(key)
            self.bytes_used += size
            while self.bytes_used > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def invalidate(self, prefix_hash: str) -> int:
        """Drop every entry of the page whose prefix hash is given (all layers, kinds, codecs)."""
        with self._lock:
            self._invalidated_at[prefix_hash] = self._epoch
            self._invalidated_at.move_to_end(prefix_hash)
            self._epoch += 1
            while len(self._invalidated_at) > MAX_INVALIDATION_RECORDS:
                self._floor = self._invalidated_at.popitem(last=False)[1] + 1
            doomed = list(self._by_prefix.get(prefix_hash, ()))
            for key in doomed:
                self._drop(key)
            self.invalidated += len(doomed)
            return len(doomed)

    def invalidate_all(self) -> None:
        with self._lock:
            self._epoch += 1
            self._floor = self._epoch
            self._invalidated_at.clear()
            self.invalidated += len(self._entries)
            self._entries.clear()
            self._by_prefix.clear()
            self.bytes_used = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes_used": self.bytes_used, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "stale": self.stale, "evictions": self.evictions,
                    "invalidated": self.invalidated, "refused": self.refused}

    def _drop(self, key: PageKey) -> None:
        anchor, residual, _ = self._entries.pop(key)
        self.bytes_used -= anchor.numel() + residual.numel()
        keys = self._by_prefix.get(key.prefix_hash)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_prefix[key.prefix_hash]


class PageEncoder(Protocol):
    """Encodes page blocks of one validated layer ``x[T, H, D]`` exactly as ``codec.encode`` would."""

    codec: KVCodec
    checks_values: bool  # True: ``blocks`` itself rejects NaN / Inf (naming layer and page)

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


def _sliced_blocks(enc: EncodedKV, codec: KVCodec, count: int) -> list[Block]:
    """The first ``count`` full-page blocks inside ``enc``'s streams, as views (``layout``: page-major)."""
    name, params = codec.name, codec.params
    tokens, heads, dim = enc.num_tokens, enc.num_heads, enc.head_dim
    a_page, r_page = page_block_bytes(name, params.page_tokens, heads, dim, enc.kind, params)
    at = header_bytes(name, tokens, heads, dim, params)
    return [(enc.anchor[at + p * a_page : at + (p + 1) * a_page], enc.residual[p * r_page : (p + 1) * r_page])
            for p in range(count)]


def encode_with_cache(
    codec: KVCodec | PageEncoder,
    x: Tensor,
    kind: Kind,
    layer: int,
    page_hashes: Sequence[str],
    cache: EncodedPageCache,
    slot_hashes: Sequence[str] | None = None,
    epoch: int | None = None,
) -> EncodedKV:
    """``codec.encode(x, kind)``, byte-identical, with full pages served from / stored into ``cache``.

    ``page_hashes[p]`` (``prefix_page_hashes``) keys full page ``p``; ``slot_hashes[p]``, when given,
    must match the entry's too (``slot_digests``); ``epoch``: see ``EncodedPageCache.put``. Pages
    without a hash are encoded, not cached."""
    encoder: PageEncoder = ReferencePageEncoder(codec) if isinstance(codec, KVCodec) else codec
    base = encoder.codec
    page = base.params.page_tokens
    validate_input(x, kind, layer, page, values=not encoder.checks_values)  # a hit page was finite when encoded
    tokens, heads, dim = (int(s) for s in x.shape)
    count = len(page_sizes(tokens, page))
    cacheable = min(tokens // page, len(page_hashes), len(slot_hashes) if slot_hashes is not None else tokens)
    ckey = codec_key(base)

    def key(p: int) -> PageKey:
        return PageKey(page_hashes[p], p, layer, kind, ckey)

    def digest(p: int) -> str | None:
        return slot_hashes[p] if slot_hashes is not None else None

    blocks: list[Block | None] = [cache.get(key(p), digest(p)) for p in range(cacheable)]
    if not any(b is not None for b in blocks) and (
        base._send_residual() or not trailer_bytes(base.name, tokens, heads, dim, base.params)
    ):
        # nothing to reuse: one pass, and its full pages stored as views of its streams (the residual
        # blocks are all a trailer can need; an anchor-only codec does not keep them, so takes the loop)
        enc = encoder.encode(x, kind, layer)
        for i, block in enumerate(_sliced_blocks(enc, base, cacheable)):
            cache.put(key(i), block[0], block[1], digest(i), epoch)
        return enc
    blocks += [None] * (count - cacheable)
    p = 0
    while p < count:
        if blocks[p] is not None:
            p += 1
            continue
        end = p
        while end < count and blocks[end] is None:
            end += 1
        for i, block in enumerate(encoder.blocks(x, kind, p, end - p, layer), start=p):
            blocks[i] = block
            if i < cacheable:
                cache.put(key(i), block[0], block[1], digest(i), epoch)
        p = end
    done = [b for b in blocks if b is not None]
    empty = torch.empty(0, dtype=torch.uint8, device=x.device)
    computed = torch.cat([b[1].reshape(-1) for b in done]) if done else empty
    anchor = torch.cat([base.encode_header(x[:page]), *(b[0].reshape(-1) for b in done),  # header: sink tokens
                        base._trailer_from_residual(computed, tokens, heads, dim)])
    residual = computed if base._send_residual() else empty
    return EncodedKV(anchor, residual, tokens, heads, dim, kind, base.name)
