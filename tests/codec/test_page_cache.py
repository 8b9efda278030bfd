"""Radix-cache-aware encoding: byte-identical reuse of shared-prefix pages, invalidation, bounds."""

from __future__ import annotations

import pytest
import torch

from conftest import outlier_kv
from sglang_lynx.codec.page_cache import EncodedPageCache, encode_with_cache, prefix_page_hashes
from sglang_lynx.codec.registry import get_codec

PARAMS = {"page_tokens": 32, "chunk_tokens": 8, "group_size": 32, "sink_tokens": 2}


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
    codec = get_codec("lynx", **PARAMS)
    x = outlier_kv(96, 2, 32)
    page_bytes = sum(codec.encode_page_range(x, "k", 0, 1)[i].numel() for i in range(2))
    cache = EncodedPageCache(max_bytes=2 * page_bytes)
    encode_with_cache(codec, x, "k", 0, prefix_page_hashes(list(range(96)), 32), cache)
    assert len(cache) == 2 and cache.evictions == 1 and cache.bytes_used == 2 * page_bytes
