"""Radix-cache-aware encoding: byte-identical reuse of shared-prefix pages, invalidation, bounds."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.page_cache import EncodedPageCache, prefix_page_hashes
from sglang_lynx.codec.page_reuse_encode import encode_with_cache
from sglang_lynx.codec.registry import get_codec

PARAMS = {"page_tokens": 32, "chunk_tokens": 8, "key_chunk_tokens": 8, "group_size": 32, "sink_tokens": 2}


@pytest.mark.parametrize("name", ["lynx", "lynx-int4", "lynx-paper", "kivi-int4", "bf16"])
def test_cached_encoding_is_byte_identical_and_reused(name: str) -> None:
    codec = get_codec(name, **PARAMS)
    cache = EncodedPageCache(max_bytes=1 << 24)
    ids = list(range(1000, 1100))
    x = outlier_kv(100, 2, 32, seed=9)
    hashes = prefix_page_hashes(ids, 32)
    assert len(hashes) == 3
    first = encode_with_cache(codec, x, "k", 4, hashes, cache)
    direct = codec.encode(x, "k")
    assert torch.equal(first.anchor, direct.anchor) and torch.equal(first.residual, direct.residual)
    assert cache.hits == 0 and len(cache) == 3

    # a second request shares the first 64 tokens (2 pages), then diverges
    ids2 = ids[:64] + [7] * 40
    x2 = torch.cat([x[:64], outlier_kv(40, 2, 32, seed=10)])
    second = encode_with_cache(codec, x2, "k", 4, prefix_page_hashes(ids2, 32), cache)
    assert cache.hits == 2
    assert torch.equal(second.anchor, codec.encode(x2, "k").anchor)

    assert cache.invalidate(hashes[1]) == 1
    misses = cache.misses
    again = encode_with_cache(codec, x2, "k", 4, prefix_page_hashes(ids2, 32), cache)
    assert cache.hits == 4  # pages 0 and 2 hit ...
    assert cache.misses == misses + 1  # ... page 1 had been invalidated and was encoded again
    assert torch.equal(again.anchor, second.anchor)


def test_hashes_are_prefix_dependent() -> None:
    a = prefix_page_hashes([1, 2, 3, 4, 5, 6], 2)
    b = prefix_page_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))
    assert prefix_page_hashes([1, 2, 3, 4, 5], 2) == a[:2]


def test_cache_is_bounded_lru() -> None:
    """The bound counts the memory held: a request's entries share its encoded streams as their backing,
    counted once while any entry holds it."""
    codec = get_codec("lynx", **PARAMS)
    stream = sum(codec.stream_bytes(96, 2, 32, "k"))  # one request's backing: its anchor + residual
    cache = EncodedPageCache(max_bytes=stream + stream // 2)
    encode_with_cache(codec, outlier_kv(96, 2, 32), "k", 0, prefix_page_hashes(list(range(96)), 32), cache)
    assert len(cache) == 3 and cache.bytes_used == stream  # three pages, one backing
    other = prefix_page_hashes(list(range(500, 596)), 32)
    encode_with_cache(codec, outlier_kv(96, 2, 32, seed=5), "k", 0, other, cache)
    assert len(cache) == 3 and cache.evictions == 3 and cache.bytes_used == stream  # the first request's went
    tiny = EncodedPageCache(max_bytes=stream - 1)
    encode_with_cache(codec, outlier_kv(96, 2, 32), "k", 0, prefix_page_hashes(list(range(96)), 32), tiny)
    assert len(tiny) == 0 and tiny.bytes_used == 0


def test_slot_digest_and_epoch_guard_entries() -> None:
    import sglang_lynx.codec.page_cache as pc

    a, r = torch.zeros(4, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8)
    entry = pc.PageEntry.of([(a, r)])
    cache = EncodedPageCache(max_bytes=1 << 20)
    key = pc.PageKey("h0", 0, "c", (("k", 0),))
    cache.put(key, entry, slot_digest="s0")
    assert cache.get(key, "s1") is None and cache.stale == 1 and len(cache) == 0  # other slots: dropped
    before = cache.epoch()
    cache.invalidate("h0")
    cache.put(key, entry, "s0", epoch=before)  # read before the invalidation: refused
    assert len(cache) == 0 and cache.refused == 1
    cache.put(key, entry, "s0", epoch=cache.epoch())  # read after it: stored
    got = cache.get(key, "s0")
    assert got is not None and torch.equal(got.block(0)[0], a) and torch.equal(got.block(0)[1], r)
    other = pc.PageKey("h1", 1, "c", (("k", 0),))
    before = cache.epoch()
    cache.invalidate_all()
    cache.put(other, entry, None, epoch=before)
    assert len(cache) == 0 and cache.refused == 2


def test_invalidation_record_overflow_refuses_older_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang_lynx.codec.page_cache as pc

    monkeypatch.setattr(pc, "MAX_INVALIDATION_RECORDS", 2)
    a = torch.zeros(4, dtype=torch.uint8)
    entry, streams = pc.PageEntry.of([(a, a)]), (("k", 0),)
    cache = EncodedPageCache(max_bytes=1 << 20)
    before = cache.epoch()
    for h in ("x", "y", "z"):  # "x"'s record falls out: every put older than it is refused
        cache.invalidate(h)
    cache.put(pc.PageKey("x", 0, "c", streams), entry, None, epoch=before)
    cache.put(pc.PageKey("w", 0, "c", streams), entry, None, epoch=before)
    assert len(cache) == 0 and cache.refused == 2
    cache.put(pc.PageKey("x", 0, "c", streams), entry, None, epoch=cache.epoch())
    assert len(cache) == 1


@pytest.mark.parametrize("name", ["lynx", "lynx-int4", "lynx-int8", "int8", "kivi-int2"])
def test_a_trailer_that_reaches_into_reused_pages(name: str) -> None:
    """The second prompt extends the first by 10 tokens: its trailer (last 48 tokens) is mostly the
    residual of a reused page, also for lynx-int4, which never sends its residual."""
    codec = get_codec(name, recent_tokens=48, **PARAMS)
    cache = EncodedPageCache(max_bytes=1 << 24)
    x = outlier_kv(64, 2, 32, seed=3)
    encode_with_cache(codec, x, "v", 0, prefix_page_hashes(list(range(64)), 32), cache)
    x2 = torch.cat([x, outlier_kv(10, 2, 32, seed=4)])
    got = encode_with_cache(codec, x2, "v", 0, prefix_page_hashes(list(range(74)), 32), cache)
    want = codec.encode(x2, "v")
    assert cache.hits == 2
    assert torch.equal(got.anchor, want.anchor) and torch.equal(got.residual, want.residual)


@pytest.mark.parametrize("name", ["lynx", "lynx-int4", "int8"])
def test_several_streams_share_one_entry_per_page(name: str) -> None:
    from sglang_lynx.codec.page_reuse_encode import encode_streams_with_cache

    codec = get_codec(name, **PARAMS)
    cache = EncodedPageCache(max_bytes=1 << 24)
    layers = [outlier_kv(100, 2, 32, seed=s) for s in range(3)]
    streams = [("k", i, x) for i, x in enumerate(layers)] + [("v", i, x) for i, x in enumerate(layers)]
    ids = list(range(100))
    first = encode_streams_with_cache(codec, streams, prefix_page_hashes(ids, 32), cache)
    assert len(cache) == 3 and cache.hits == 0  # one entry per full page, holding all six streams
    tail = [outlier_kv(40, 2, 32, seed=9 + s) for s in range(3)]
    layers2 = [torch.cat([x[:64], t]) for x, t in zip(layers, tail, strict=True)]
    streams2 = [("k", i, x) for i, x in enumerate(layers2)] + [("v", i, x) for i, x in enumerate(layers2)]
    second = encode_streams_with_cache(codec, streams2, prefix_page_hashes(ids[:64] + [7] * 40, 32), cache)
    assert cache.hits == 2
    for group, (anchor, residual) in ((streams, first), (streams2, second)):
        want = [codec.encode(x, kind) for kind, _, x in group]
        assert torch.equal(anchor, torch.cat([w.anchor for w in want]))
        assert torch.equal(residual, torch.cat([w.residual for w in want]))
