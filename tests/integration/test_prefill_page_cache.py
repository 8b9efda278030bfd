"""Encoded-page reuse on the prefill side, against the pinned SGLang's real KV allocator and radix cache.

The allocator hooks are applied through SGLang's own ``HookRegistry`` (as the plugin does in a
server) and removed afterwards. A ``RadixCache`` (the pinned SGLang's, over a real
``TokenToKVPoolAllocator``; no model) holds slot indices: what is checked is that a radix eviction
invalidates exactly the pages whose slots it frees, that clearing the pool clears everything, that
an encode which read its KV before a free cannot insert afterwards, and that a page read from other
slots is not served. ``encode_request_streams`` with reuse equals it without, byte for byte.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.codec import encode_request_streams
from sglang_lynx.integration.transport.page_cache import PrefillPageReuse, reuse_of

PAGE = 256
LAYERS = 2
PER_PAGE = 1  # cache entries per page (one holds k and v of every layer)


@pytest.fixture
def radix(monkeypatch: pytest.MonkeyPatch):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_lynx.integration.hook_targets import register
    from sglang_lynx.integration.transport import kv_manager as transport_hooks

    for name in ("free", "clear"):  # undone after the test: the class is patched in place
        monkeypatch.setattr(TokenToKVPoolAllocator, name, TokenToKVPoolAllocator.__dict__[name])
    saved_hooks, saved_patched = dict(HookRegistry._hooks), set(HookRegistry._patched)
    HookRegistry.reset()
    target = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
    register(f"{target}.free", transport_hooks._after_kv_free, "after")
    register(f"{target}.clear", transport_hooks._after_kv_clear, "after")
    HookRegistry.apply_hooks()
    reuse = PrefillPageReuse(1 << 26, PAGE)  # attached to the allocator by its first remember
    try:
        allocator = TokenToKVPoolAllocator(8192, torch.bfloat16, "cpu", None, False)
        tree = RadixCache.create_simulated(mock_allocator=allocator)
        yield SimpleNamespace(tree=tree, tree_cache=tree, token_to_kv_pool_allocator=allocator), reuse
    finally:
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


def _insert(sched, ids: list[int], slots: list[int]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    sched.tree.insert(InsertParams(key=RadixKey(array("q", ids)), value=torch.tensor(slots, dtype=torch.int64)))


def _evict(sched, tokens: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    sched.tree.evict(EvictParams(num_tokens=tokens))


def _alloc(sched, n: int) -> list[int]:
    return sched.token_to_kv_pool_allocator.alloc(n).tolist()


def _kv(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 4.0, 64)
    def layer() -> torch.Tensor:
        return (torch.randn(tokens, 3, 64, generator=g) * scale).bfloat16()
    return [layer() for _ in range(LAYERS)], [layer() for _ in range(LAYERS)]


def _encode(reuse: PrefillPageReuse, room: int, ids: list[int], slots: list[int], kv, sched, mode: str = "lynx"):
    config = LynxConfig(mode=mode)
    codec = get_codec(config.codec_name, **config.codec_params())
    reuse.remember(room, ids, sched)
    keys = reuse.keys_for(room, torch.tensor(slots, dtype=torch.int64))
    assert keys is not None
    got = encode_request_streams(kv[0], kv[1], codec, config, keys)
    want = encode_request_streams(kv[0], kv[1], codec, config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "reuse changed the bytes"
    return got


def _shared_kv(a, b, tokens: int):
    """KV of request b whose first ``tokens`` tokens are request a's (the radix hit's slots)."""
    return tuple([torch.cat([x[:tokens], y[tokens:]]) for x, y in zip(xs, ys, strict=True)]
                 for xs, ys in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", ["lynx", "lynx-int4", "int8", "kivi-int4"])
def test_shared_prefix_pages_are_reused_byte_identically(radix, mode: str) -> None:
    sched, reuse = radix
    ids_a, slots_a = list(range(1000, 1700)), _alloc(sched, 700)
    kv_a = _kv(700, 1)
    _encode(reuse, 1, ids_a, slots_a, kv_a, sched, mode)
    assert reuse.cache.hits == 0 and len(reuse.cache) == 2 * PER_PAGE  # 2 full pages
    _insert(sched, ids_a, slots_a)
    # b shares 600 tokens and their slots (a radix hit), then its own 100 tokens in new slots
    ids_b = ids_a[:600] + list(range(5000, 5100))
    kv_b = _shared_kv(kv_a, _kv(700, 2), 600)
    _encode(reuse, 2, ids_b, slots_a[:600] + _alloc(sched, 100), kv_b, sched, mode)
    assert reuse.cache.hits == 2 * PER_PAGE


def test_radix_eviction_invalidates_the_pages_whose_slots_it_frees(radix) -> None:
    sched, reuse = radix
    ids_a, ids_b = list(range(1000, 1700)), list(range(1000, 1300)) + list(range(9000, 9400))
    slots_a = _alloc(sched, 700)
    slots_b = slots_a[:300] + _alloc(sched, 400)
    kv_a = _kv(700, 1)
    _encode(reuse, 1, ids_a, slots_a, kv_a, sched)
    _insert(sched, ids_a, slots_a)
    _insert(sched, ids_b, slots_b)  # splits a's node at 300
    _encode(reuse, 2, ids_b, slots_b, _shared_kv(kv_a, _kv(700, 3), 300), sched)
    # a: pages 0 (slots in the shared node) and 1 (in a's leaf); b: its page 1 (in b's leaf)
    assert len(reuse.cache) == 3 * PER_PAGE and reuse.cache.hits == PER_PAGE
    _evict(sched, 1)  # the least recently used leaf: a's tokens [300, 700)
    assert len(reuse.cache) == 2 * PER_PAGE and reuse.cache.invalidated == PER_PAGE
    _evict(sched, 1000)  # b's leaf, then the shared node
    assert len(reuse.cache) == 0 and reuse.stats()["pages_tracked"] == 0
    # the freed slots come back for the same prompt: encoded again (no stale hit), stored again
    _encode(reuse, 3, ids_a, _alloc(sched, 700), _kv(700, 4), sched)
    assert len(reuse.cache) == 2 * PER_PAGE
    sched.token_to_kv_pool_allocator.clear()  # /flush_cache
    assert len(reuse.cache) == 0 and reuse.stats()["pages_tracked"] == 0


def test_a_slot_shared_by_two_pages_invalidates_both(radix) -> None:
    sched, reuse = radix
    shared = _alloc(sched, 300)  # positions 0..299 of two prompts that diverge at 300
    ids_a, ids_b = list(range(1000, 1600)), list(range(1000, 1300)) + list(range(7000, 7300))
    kv_a = _kv(600, 1)
    _encode(reuse, 1, ids_a, shared + _alloc(sched, 300), kv_a, sched)
    _encode(reuse, 2, ids_b, shared + _alloc(sched, 300), _shared_kv(kv_a, _kv(600, 2), 300), sched)
    assert len(reuse.cache) == 3 * PER_PAGE  # page 0 shared; each prompt's page 1 holds slots 256..299
    sched.token_to_kv_pool_allocator.free(torch.tensor(shared[280:281]))  # one slot of both pages 1
    assert len(reuse.cache) == PER_PAGE and reuse.stats()["pages_tracked"] == 1


def test_an_encode_that_read_its_kv_before_a_free_does_not_insert(radix) -> None:
    sched, reuse = radix
    ids, slots = list(range(1000, 1600)), _alloc(sched, 600)
    reuse.remember(7, ids, sched)
    keys = reuse.keys_for(7, torch.tensor(slots))
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots[:10]))  # page 0 freed while the encode is queued
    config = LynxConfig()
    kv = _kv(600, 4)
    encode_request_streams(kv[0], kv[1], get_codec("lynx", **config.codec_params()), config, keys)
    assert reuse.cache.refused == PER_PAGE and len(reuse.cache) == PER_PAGE  # page 1 only


def test_a_page_read_from_other_slots_is_not_served(radix) -> None:
    sched, reuse = radix
    ids = list(range(1000, 1600))
    _encode(reuse, 1, ids, _alloc(sched, 600), _kv(600, 5), sched)
    # the same tokens computed again into other slots (no radix hit): other KV, no reuse
    _encode(reuse, 2, ids, _alloc(sched, 600), _kv(600, 6), sched)
    assert reuse.cache.hits == 0 and reuse.cache.stale == 2 * PER_PAGE


def test_prompts_that_do_not_match_their_kv_are_not_keyed(radix) -> None:
    sched, reuse = radix
    reuse.remember(1, list(range(300)), sched)
    assert reuse.keys_for(1, torch.arange(299)) is None  # prompt and KV disagree
    assert reuse.keys_for(2, torch.arange(300)) is None  # no prompt remembered
    reuse.remember(3, list(range(100)), sched)
    assert reuse.keys_for(3, torch.arange(100)) is None  # not one full page
    assert reuse.stats()["requests_unkeyed"] == 3 and reuse.stats()["requests_keyed"] == 0


def test_reuse_is_off_without_prefix_sharing_or_a_known_allocator() -> None:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    allocator = TokenToKVPoolAllocator(1024, torch.bfloat16, "cpu", None, False)
    no_sharing = SimpleNamespace(tree_cache=RadixCache.create_simulated(disable=True),
                                 token_to_kv_pool_allocator=allocator)
    other_allocator = SimpleNamespace(tree_cache=RadixCache.create_simulated(), token_to_kv_pool_allocator=object())
    for sched in (no_sharing, other_allocator):
        reuse = PrefillPageReuse(1 << 20, PAGE)
        reuse.remember(1, list(range(300)), sched)
        assert reuse.enabled is False and reuse.keys_for(1, torch.arange(300)) is None
    assert PrefillPageReuse(0, PAGE).enabled is False


def test_two_servers_in_one_process_invalidate_only_their_own_pages(radix) -> None:
    """Each server's page reuse hangs off its own KV allocator: a free or a clear in one pool never
    touches the other's pages, even at the same slot numbers; a closed server's reuse hears nothing."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache

    sched, reuse = radix
    allocator2 = TokenToKVPoolAllocator(8192, torch.bfloat16, "cpu", None, False)
    tree2 = RadixCache.create_simulated(mock_allocator=allocator2)
    sched2 = SimpleNamespace(tree=tree2, tree_cache=tree2, token_to_kv_pool_allocator=allocator2)
    reuse2 = PrefillPageReuse(1 << 26, PAGE)
    ids, kv = list(range(1000, 1600)), _kv(600, 1)
    slots1, slots2 = _alloc(sched, 600), _alloc(sched2, 600)
    assert slots1 == slots2  # the same slot numbers, in two pools
    _encode(reuse, 1, ids, slots1, kv, sched)
    _encode(reuse2, 1, ids, slots2, kv, sched2)
    assert reuse_of(sched.token_to_kv_pool_allocator) is reuse and reuse_of(allocator2) is reuse2
    assert len(reuse.cache) == len(reuse2.cache) == 2 * PER_PAGE
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots1[:10]))  # page 0 of server 1 only
    assert len(reuse.cache) == PER_PAGE and len(reuse2.cache) == 2 * PER_PAGE
    allocator2.clear()  # /flush_cache on server 2
    assert len(reuse2.cache) == 0 and len(reuse.cache) == PER_PAGE
    reuse.detach()  # server 1 closes
    assert reuse_of(sched.token_to_kv_pool_allocator) is None and len(reuse.cache) == 0
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots1[300:310]))  # heard by nobody; no error
    assert reuse.stats()["hook_errors"] == 0


SGLANG_PAGE = 16  # --page-size 16: SGLang's pages; the codec's pages stay PAGE (256) tokens


@pytest.fixture
def paged_radix(monkeypatch: pytest.MonkeyPatch):
    """The radix fixture with SGLang's paged allocator and a paged radix cache (the hooks of ``--page-size``)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_lynx.integration.hook_targets import register
    from sglang_lynx.integration.transport import kv_manager as transport_hooks

    for name in ("free", "free_page_ids", "clear"):  # undone after the test: the class is patched in place
        monkeypatch.setattr(PagedTokenToKVPoolAllocator, name, PagedTokenToKVPoolAllocator.__dict__[name])
    saved_hooks, saved_patched = dict(HookRegistry._hooks), set(HookRegistry._patched)
    HookRegistry.reset()
    target = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
    register(f"{target}.free", transport_hooks._after_kv_free, "after")
    register(f"{target}.free_page_ids", transport_hooks._after_kv_free_pages, "after")
    register(f"{target}.clear", transport_hooks._after_kv_clear, "after")
    HookRegistry.apply_hooks()
    reuse = PrefillPageReuse(1 << 26, PAGE)
    try:
        allocator = PagedTokenToKVPoolAllocator(8192, SGLANG_PAGE, torch.bfloat16, "cpu", None, False)
        tree = RadixCache.create_simulated(mock_allocator=allocator, page_size=SGLANG_PAGE)
        yield SimpleNamespace(tree=tree, tree_cache=tree, token_to_kv_pool_allocator=allocator), reuse
    finally:
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


def _alloc_paged(sched, tokens: int) -> list[int]:
    """A request's token slots: whole SGLang pages, the last one's tail unused (``transport.pages``)."""
    pages = -(-tokens // SGLANG_PAGE)
    return sched.token_to_kv_pool_allocator.alloc(pages * SGLANG_PAGE).tolist()[:tokens]


def test_paged_pools_reuse_and_invalidate_codec_pages(paged_radix) -> None:
    """``--page-size 16``: a radix-shared prefix (whole SGLang pages) reuses the codec pages it holds;
    pages freed by slots (radix eviction) or by id (``free_kv_row`` -> ``free_page_ids``) invalidate
    the codec pages they lie in, and only those; ``clear`` clears all."""
    sched, reuse = paged_radix
    ids_a, slots_a = list(range(1000, 1700)), _alloc_paged(sched, 700)
    kv_a = _kv(700, 1)
    _encode(reuse, 1, ids_a, slots_a, kv_a, sched)
    assert reuse.enabled is True and len(reuse.cache) == 2 * PER_PAGE
    _insert(sched, ids_a[:688], slots_a[:688])  # the radix cache holds whole SGLang pages (43 of 16)
    ids_b = ids_a[:592] + list(range(5000, 5108))  # b shares 37 SGLang pages = codec pages 0 and 1
    _encode(reuse, 2, ids_b, slots_a[:592] + _alloc_paged(sched, 108), _shared_kv(kv_a, _kv(700, 2), 592), sched)
    assert reuse.cache.hits == 2 * PER_PAGE
    _evict(sched, 1000)  # the radix eviction frees a's pages by slots: both codec pages go
    assert len(reuse.cache) == 0 and reuse.cache.invalidated == 2 * PER_PAGE
    slots_c = _alloc_paged(sched, 700)
    _encode(reuse, 3, ids_a, slots_c, _kv(700, 3), sched)
    assert len(reuse.cache) == 2 * PER_PAGE
    page_of_300 = slots_c[300] // SGLANG_PAGE  # an SGLang page inside codec page 1
    sched.token_to_kv_pool_allocator.free_page_ids(torch.tensor([page_of_300]))
    assert len(reuse.cache) == PER_PAGE and reuse.cache.invalidated == 3 * PER_PAGE  # codec page 1 only
    sched.token_to_kv_pool_allocator.clear()
    assert len(reuse.cache) == 0 and reuse.stats()["pages_tracked"] == 0
