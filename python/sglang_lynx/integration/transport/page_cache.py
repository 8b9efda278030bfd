"""Prefill side: encoded pages of a radix-cached prefix are reused by the requests that share it.

SGLang's radix cache hands a request that shares a cached prefix the very KV-pool slots of that
prefix, and a slot's KV is not rewritten while it is allocated. So an encoded page stays right for as
long as none of its slots has been freed: when the radix cache evicts a node (or a request's
uncached KV is released, or ``/flush_cache`` clears the pool) the slots go back to SGLang's KV
allocator, and that is where this module listens.

Lifecycle in one prefill server (one ``PrefillPageReuse``, owned by its Lynx prefill side):

1. ``PrefillBootstrapQueue.add`` (hook) -> ``remember(room, token_ids, scheduler)``: the request's
   prompt, by bootstrap room. The first call checks that the tree cache shares prefixes and that the
   KV allocator is SGLang's ``TokenToKVPoolAllocator`` or, with ``--page-size`` > 1,
   ``PagedTokenToKVPoolAllocator`` (whose ``free`` / ``free_page_ids`` / ``clear`` we hook); otherwise
   reuse is off for the server (logged once). When reuse is on, that call also attaches this object
   to the scheduler's KV allocator (``allocator._lynx_page_reuse``): the allocator hooks find the
   reuse of the server whose slots are freed from the allocator itself (:func:`reuse_of`), so two
   servers in one process never invalidate each other's pages. Before that first call no page is
   registered, so a free has nothing to invalidate.
2. At submit (all chunks copied, inside SGLang's send call, so the request still owns its slots),
   ``keys_for(room, slots)``: the pages' prefix hashes, slot digests and the cache epoch
   (``codec.page_cache``), or None (no prompt remembered, a prompt whose length is not the KV's,
   fewer than one full page). Each full page's slots are registered as belonging to its prefix hash.
   The encode thread then runs ``encode_with_cache`` per layer.
3. ``free`` (hook, scheduler thread) -> ``reuse_of(allocator).on_slots_freed``: every page
   with a freed slot is invalidated (all layers, kinds); ``free_page_ids`` (paged allocator) ->
   ``on_pages_freed``: the same for every slot of each freed SGLang page. ``clear`` ->
   ``on_pool_cleared``: all are.

Pages here are the codec's (``page_tokens`` P, default 256), keyed by the request's token slots in
prompt order; SGLang's page size only changes which slots those are (``transport.pages``). With
``--page-size`` dividing P a radix-shared prefix holds whole codec pages.

Invariant: a cached page is served only for the same token prefix read from the same KV slots, none
of which was freed since it was read (an encode that read its KV before such a free cannot insert
afterwards: the epoch). Any error inside a hook clears the whole cache (safe) and is logged.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from sglang_lynx.codec.page_cache import EncodedPageCache, prefix_page_hashes, slot_digests

logger = logging.getLogger("sglang_lynx.transport")

MAX_REMEMBERED = 4096  # prompts waiting for their KV (oldest dropped first)
ALLOCATOR_ATTR = "_lynx_page_reuse"  # on a KV allocator: the PrefillPageReuse of the server it serves


@dataclass(frozen=True)
class PageReuse:
    """What one request's encode needs to use the cache."""

    cache: EncodedPageCache
    page_hashes: list[str]
    slot_hashes: list[str]
    epoch: int  # taken while the request still owned its KV slots (EncodedPageCache.put)


class PrefillPageReuse:
    def __init__(self, max_bytes: int, page_tokens: int) -> None:
        self.cache = EncodedPageCache(max_bytes)
        self.page_tokens = page_tokens
        self.enabled: bool | None = None if max_bytes > 0 else False  # None: SGLang's caches not checked yet
        self._prompts: OrderedDict[int, Sequence[int]] = OrderedDict()
        self._owner = np.full(0, -1, dtype=np.int64)  # slot -> page group id (-1: none)
        self._groups: dict[tuple[str, str], int] = {}  # (prefix hash, slot digest) -> group id
        self._group_pages: dict[int, tuple[tuple[str, str], np.ndarray]] = {}  # group id -> (its key, slots)
        # a slot in two pages (same start, other continuations) names the later one; it carries the earlier
        self._displaced: dict[int, set[int]] = {}
        self._next_group = 0
        self._lock = threading.Lock()
        self._allocator: Any = None  # the KV allocator this reuse is attached to (see remember)
        self.requests_keyed = self.requests_unkeyed = self.pages_freed = self.hook_errors = 0

    # ----- scheduler thread -----
    def remember(self, room: int, token_ids: Sequence[int], scheduler: Any) -> None:
        if self.enabled is None:
            self.enabled = _caches_supported(scheduler)
            if self.enabled:
                self._allocator = scheduler.token_to_kv_pool_allocator
                setattr(self._allocator, ALLOCATOR_ATTR, self)
        if not self.enabled:
            return
        with self._lock:
            self._prompts[room] = token_ids
            while len(self._prompts) > MAX_REMEMBERED:
                self._prompts.popitem(last=False)

    def on_slots_freed(self, indices: Any) -> None:
        try:
            slots = np.asarray(indices.cpu() if isinstance(indices, Tensor) else indices, dtype=np.int64).ravel()
            with self._lock:
                slots = slots[(slots >= 0) & (slots < len(self._owner))]
                doomed = self._drop_groups_locked([int(g) for g in np.unique(self._owner[slots]) if g >= 0])
        except Exception:  # never break SGLang's free; drop everything rather than guess
            self.hook_errors += 1
            logger.exception("lynx: could not read freed KV slots; clearing the encoded-page cache")
            self.on_pool_cleared()
            return
        self.pages_freed += len(doomed)
        for prefix_hash in doomed:
            self.cache.invalidate(prefix_hash)

    def on_pages_freed(self, page_ids: Any, page_size: int) -> None:
        """SGLang pages freed by id (``--page-size`` > 1): every token slot of each page is freed."""
        try:
            pages = np.asarray(page_ids.cpu() if isinstance(page_ids, Tensor) else page_ids, dtype=np.int64).ravel()
            slots = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).ravel()
        except Exception:  # never break SGLang's free; drop everything rather than guess
            self.hook_errors += 1
            logger.exception("lynx: could not read freed KV pages; clearing the encoded-page cache")
            self.on_pool_cleared()
            return
        self.on_slots_freed(slots)

    def on_pool_cleared(self) -> None:
        with self._lock:
            self._owner[:] = -1
            self._groups.clear()
            self._group_pages.clear()
            self._displaced.clear()
        self.cache.invalidate_all()

    def detach(self) -> None:
        """The server closes: its allocator's frees no longer reach this object; the cache is emptied."""
        if self._allocator is not None and getattr(self._allocator, ALLOCATOR_ATTR, None) is self:
            delattr(self._allocator, ALLOCATOR_ATTR)
        self._allocator, self.enabled = None, False
        self.on_pool_cleared()

    # ----- transfer worker -----
    def keys_for(self, room: int, slots: Tensor) -> PageReuse | None:
        with self._lock:
            prompt = self._prompts.pop(room, None)
        tokens, page = int(slots.numel()), self.page_tokens
        if not self.enabled or prompt is None or len(prompt) != tokens or tokens < page:
            self.requests_unkeyed += 1
            return None
        hashes, digests = prefix_page_hashes(prompt, page), slot_digests(slots, page)
        epoch = self.cache.epoch()  # before the slots are registered: a free from now on refuses the puts
        flat = slots.to("cpu").numpy().astype(np.int64)
        with self._lock:
            top = int(flat.max()) + 1
            if top > len(self._owner):
                self._owner = np.concatenate([self._owner, np.full(top - len(self._owner), -1, dtype=np.int64)])
            for p, key in enumerate(zip(hashes, digests, strict=True)):
                group = self._groups.get(key)
                if group is None:
                    group = self._groups[key] = self._next_group
                    self._next_group += 1
                    self._group_pages[group] = (key, flat[p * page : (p + 1) * page].copy())
                mine = flat[p * page : (p + 1) * page]
                others = {int(g) for g in np.unique(self._owner[mine]) if g >= 0 and g != group}
                if others:
                    self._displaced.setdefault(group, set()).update(others)
                self._owner[mine] = group
        self.requests_keyed += 1
        return PageReuse(self.cache, hashes, digests, epoch)

    def forget(self, room: int) -> None:
        """``room`` is encoded without the cache (streamed while its prefill ran): drop its prompt."""
        with self._lock:
            self._prompts.pop(room, None)
        self.requests_unkeyed += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            waiting, pages = len(self._prompts), len(self._group_pages)
        return {"enabled": self.enabled, **self.cache.stats(), "requests_keyed": self.requests_keyed,
                "requests_unkeyed": self.requests_unkeyed, "prompts_waiting": waiting, "pages_tracked": pages,
                "pages_freed": self.pages_freed, "hook_errors": self.hook_errors}

    def _drop_groups_locked(self, groups: list[int]) -> list[str]:
        """Forget ``groups`` and every group they displaced (transitively); their prefix hashes."""
        hashes, todo = [], list(groups)
        while todo:
            group = todo.pop()
            todo.extend(self._displaced.pop(group, ()))
            found = self._group_pages.pop(group, None)
            if found is None:
                continue
            key, slots = found
            del self._groups[key]
            self._owner[slots[self._owner[slots] == group]] = -1
            hashes.append(key[0])
        return hashes


def _caches_supported(scheduler: Any) -> bool:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    tree = getattr(scheduler, "tree_cache", None)
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    sharing = tree is not None and bool(getattr(tree, "supports_prefix_sharing", lambda: False)())
    cls: Any = type(allocator)
    # exactly SGLang's allocators whose every way of freeing a slot is hooked (kv_manager.py): a subclass
    # that frees by another path would leave encoded pages of reused slots in the cache
    hooked = cls in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
    if not (sharing and hooked):
        logger.warning("lynx: encoded-page reuse is off (tree cache %s, prefix sharing %s, KV allocator %s; reuse "
                       "needs prefix sharing and SGLang's TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator)",
                       type(tree).__name__, sharing, cls.__name__)
    return sharing and hooked


def reuse_of(allocator: Any) -> PrefillPageReuse | None:
    """The page reuse attached to ``allocator`` by its server's first ``remember``, or None."""
    reuse = getattr(allocator, ALLOCATOR_ATTR, None)
    return reuse if isinstance(reuse, PrefillPageReuse) else None
