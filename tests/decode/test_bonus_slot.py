"""``decode.bonus_slot.reserve_bonus_slot`` on SGLang's own allocators and request-to-token pool (the pinned
SGLang, CPU tensors, no model): the slot it takes is the one SGLang's next decode step would take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sglang_lynx.integration.decode.bonus_slot import bonus_room, reserve_bonus_slot


@dataclass
class KV:
    req_pool_idx: int
    kv_allocated_len: int
    kv_committed_len: int


class Req:
    def __init__(self, row: int, length: int, max_new_tokens: int | None = 100) -> None:
        self.kv = KV(row, length, length)
        self.sampling_params = type("P", (), {"max_new_tokens": max_new_tokens})()


class NoSharingCache:
    """The tree-cache surface SGLang's allocation functions use (a decode server without prefix sharing)."""

    def __init__(self, allocator: Any) -> None:
        self.token_to_kv_pool_allocator = allocator
        self.page_size = allocator.page_size

    def supports_prefix_sharing(self) -> bool:
        return False


def _setup(page_size: int, slots: int = 64) -> tuple[Any, Any, Any]:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    if page_size == 1:
        allocator = TokenToKVPoolAllocator(slots, torch.bfloat16, "cpu", None, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(slots, page_size, torch.bfloat16, "cpu", None, False)
    pool = ReqToTokenPool(4, 32, "cpu", False)
    runner = type("Runner", (), {"req_to_token_pool": pool})()
    return allocator, pool, runner


def _fill_row(allocator: Any, pool: Any, row: int, length: int) -> torch.Tensor:
    need = -(-length // allocator.page_size) * allocator.page_size
    locs = allocator.alloc(need)
    pool.write((row, slice(0, length)), locs[:length].to(torch.int32))
    return locs


def test_page_size_one_takes_one_free_slot() -> None:
    allocator, pool, runner = _setup(1)
    _fill_row(allocator, pool, 1, 10)
    free_before = allocator.available_size()
    req = Req(1, 10)
    assert reserve_bonus_slot(req, runner, NoSharingCache(allocator))
    slot = int(pool.req_to_token[1, 10])
    assert slot > 0 and slot not in pool.req_to_token[1, :10].tolist()
    assert allocator.available_size() == free_before - 1
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 11


def test_paged_mid_page_takes_the_next_slot_of_the_last_page() -> None:
    allocator, pool, runner = _setup(4)
    locs = _fill_row(allocator, pool, 2, 10)  # pages for 12 slots, 10 used
    free_before = allocator.available_size()
    req = Req(2, 10)
    assert reserve_bonus_slot(req, runner, NoSharingCache(allocator))
    assert int(pool.req_to_token[2, 10]) == int(locs[10]) == int(locs[9]) + 1
    assert allocator.available_size() == free_before  # no new page
    assert req.kv.kv_allocated_len == 11


def test_paged_at_a_page_boundary_takes_a_new_page() -> None:
    allocator, pool, runner = _setup(4)
    locs = _fill_row(allocator, pool, 2, 8)
    free_before = allocator.available_size()
    req = Req(2, 8)
    assert reserve_bonus_slot(req, runner, NoSharingCache(allocator))
    slot = int(pool.req_to_token[2, 8])
    assert slot % 4 == 0 and slot // 4 not in set((locs // 4).tolist())
    assert allocator.available_size() == free_before - 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_free_slot_reserves_nothing(page_size: int) -> None:
    allocator, pool, runner = _setup(page_size, slots=16)
    _fill_row(allocator, pool, 0, 16)  # the whole pool
    req = Req(0, 16)
    before = pool.req_to_token[0].clone()
    assert not reserve_bonus_slot(req, runner, NoSharingCache(allocator))
    assert torch.equal(pool.req_to_token[0], before) and req.kv.kv_allocated_len == 16


def test_a_full_row_reserves_nothing() -> None:
    allocator, pool, runner = _setup(1)
    _fill_row(allocator, pool, 0, 32)
    width = pool.req_to_token.shape[1]
    req = Req(0, width)
    assert not reserve_bonus_slot(req, runner, NoSharingCache(allocator))
    assert req.kv.kv_allocated_len == width


def test_bonus_room_follows_max_new_tokens() -> None:
    assert bonus_room(Req(0, 1, max_new_tokens=5), 4) and not bonus_room(Req(0, 1, max_new_tokens=5), 5)
    assert bonus_room(Req(0, 1, max_new_tokens=None), 10_000)


def test_paged_without_a_free_page_reserves_nothing_even_mid_page() -> None:
    """Mid-page the slot needs no page, but SGLang's paged decode allocation evicts on a shortfall of a page:
    the bonus never evicts, so it wants a free page before it asks."""
    allocator, pool, runner = _setup(4, slots=16)
    _fill_row(allocator, pool, 0, 10)  # 3 pages, the last one partly used
    while allocator.alloc(4) is not None:  # every other free page taken by other requests
        pass
    req = Req(0, 10)
    assert allocator.available_size() == 0
    assert not reserve_bonus_slot(req, runner, NoSharingCache(allocator)) and req.kv.kv_allocated_len == 10
