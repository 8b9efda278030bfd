"""Radix-cache-aware page encoding: encoded pages of a shared prefix are reused, not re-encoded.

Every stream is page-major (``layout``): a page's block depends on that page's KV only (and on its
index: page 0 holds the sink tokens). In a causal model a page's KV is fixed by the token ids up to
the end of that page, so a full page is keyed by ``PageKey(prefix_hash, page_index, codec_key,
streams)``, where ``prefix_hash`` chains every token id from the start of the request to the end of
the page (``prefix_page_hashes``) and ``streams`` names the (kind, layer) streams the entry holds the
page's blocks of (one entry per page for the whole request: per-layer entries cost more Python than
the fast codec takes to encode). The partial last page is never cached (the next request's page
holds more tokens).

Token ids alone do not make two KV pages equal: a prefix computed twice (two requests racing before
the first reached the radix cache, another LoRA namespace) can differ in its last bits. So each entry
also records a *slot digest*: a hash of the KV-pool slots the page was read from. SGLang's radix
cache hands a later request the very slots of the cached prefix, and a slot's KV is never rewritten
while it is allocated; an entry is served only when the new request's page sits in the same slots
(``get`` counts a different digest as ``stale`` and drops the entry). When a slot is freed (the radix
cache evicts its node, a request's uncached KV is released) it may be reused: the integration then
calls ``invalidate`` for the pages read from it (``invalidate_all`` when the pool is cleared), so an
entry can never outlive the KV it was encoded from. An encode that read its KV before such an invalidation must not
insert afterwards: the caller takes ``epoch()`` while it still owns the slots and passes it to ``put``,
which refuses a page invalidated (or a cache cleared) since.

Lifecycle: the prefill side owns one ``EncodedPageCache`` (bounded by ``max_bytes``, LRU; thread-safe:
the encode thread reads and fills it while the scheduler thread invalidates); ``page_reuse_encode``
encodes a request through it, byte-identically. This module is the store only.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .base import KVCodec

MAX_INVALIDATION_RECORDS = 1 << 16


@dataclass(frozen=True)
class PageKey:
    prefix_hash: str
    page_index: int
    codec_key: str
    streams: tuple[tuple[str, int], ...]  # (kind, layer) of each stream whose block the entry holds, in order


@dataclass(frozen=True)
class PageEntry:
    """One page's blocks of every stream of ``PageKey.streams``: spans of a *backing* pair of uint8
    tensors (the residual as computed, also for anchor-only codecs: a trailer is cut from it). The
    entries a request stores share its encoded streams as their backing (no copy at insert); the cache
    counts a backing's bytes once, for as long as any entry holds it, so its bound is the memory held."""

    anchor: Tensor
    residual: Tensor
    anchor_spans: tuple[tuple[int, int], ...]  # (start, end) of stream i's block in ``anchor``
    residual_spans: tuple[tuple[int, int], ...]

    @property
    def backing(self) -> tuple[int, int]:
        return id(self.anchor), id(self.residual)

    @property
    def backing_bytes(self) -> int:
        return self.anchor.numel() + self.residual.numel()

    def block(self, i: int) -> tuple[Tensor, Tensor]:
        (a0, a1), (r0, r1) = self.anchor_spans[i], self.residual_spans[i]
        return self.anchor[a0:a1], self.residual[r0:r1]

    @classmethod
    def of(cls, blocks: Sequence[tuple[Tensor, Tensor]]) -> PageEntry:
        """An entry with its own backing (one copy) of ``blocks[i] = (anchor, residual)`` of stream ``i``."""
        a_spans, r_spans, a_at, r_at = [], [], 0, 0
        for a, r in blocks:
            a_spans.append((a_at, a_at + a.numel()))
            r_spans.append((r_at, r_at + r.numel()))
            a_at, r_at = a_at + a.numel(), r_at + r.numel()
        return cls(torch.cat([a.reshape(-1) for a, _ in blocks]), torch.cat([r.reshape(-1) for _, r in blocks]),
                   tuple(a_spans), tuple(r_spans))


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
        self._entries: OrderedDict[PageKey, tuple[PageEntry, str | None]] = OrderedDict()
        self._by_prefix: dict[str, set[PageKey]] = {}
        self._lock = threading.Lock()
        self._epoch = 0  # +1 per invalidation
        self._invalidated_at: OrderedDict[str, int] = OrderedDict()  # prefix hash -> epoch (bounded)
        self._floor = 0  # puts from before this epoch are refused (cleared, or the record above overflowed)
        self._backings: dict[tuple[int, int], int] = {}  # backing -> entries holding it
        self.bytes_used = 0
        self.hits = self.misses = self.stale = self.evictions = self.invalidated = self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: PageKey, slot_digest: str | None = None) -> PageEntry | None:
        """The entry stored under ``key``, if it was encoded from the same slots (None: a miss)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found[1] != slot_digest:
                self._drop(key)
                self.stale += 1
                found = None
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]

    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def put(self, key: PageKey, entry: PageEntry, slot_digest: str | None = None, epoch: int | None = None) -> None:
        """Store ``entry`` (its backing is never written again); with ``epoch`` (taken when its KV was
        read), refused if that page was invalidated since."""
        if entry.backing_bytes > self.max_bytes:
            return
        with self._lock:
            if epoch is not None and (epoch < self._floor or self._invalidated_at.get(key.prefix_hash, -1) >= epoch):
                self.refused += 1
                return
            if key in self._entries:
                self._drop(key)
            self._entries[key] = (entry, slot_digest)
            self._by_prefix.setdefault(key.prefix_hash, set()).add(key)
            refs = self._backings.get(entry.backing, 0)
            if not refs:
                self.bytes_used += entry.backing_bytes
            self._backings[entry.backing] = refs + 1
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
            self._backings.clear()
            self.bytes_used = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes_used": self.bytes_used, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "stale": self.stale, "evictions": self.evictions,
                    "invalidated": self.invalidated, "refused": self.refused}

    def _drop(self, key: PageKey) -> None:
        entry, _ = self._entries.pop(key)
        refs = self._backings.pop(entry.backing) - 1
        if refs:
            self._backings[entry.backing] = refs
        else:
            self.bytes_used -= entry.backing_bytes
        keys = self._by_prefix.get(key.prefix_hash)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_prefix[key.prefix_hash]
