"""Pure tier: arena sizing from the model / mode / pool, and the staging allocator's FIFO wait."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig, LynxConfigError
from sglang_lynx.integration.transport.arena import KVShape, stream_sizes
from sglang_lynx.transfer.arena_size import MIB, size_arena
from sglang_lynx.transfer.staging import StagingAllocator, StagingFullError, StagingTooLargeError, footprint
from sglang_lynx.transfer.streams import StreamKind

A, R = StreamKind.ANCHOR, StreamKind.RESIDUAL
SMOLLM2 = KVShape(30, 3, 64)  # the test model: 30 layers x 3 KV heads x 64 dims


def _footprint(config: LynxConfig, shape: KVShape = SMOLLM2):  # noqa: ANN202
    codec = get_codec(config.codec_name, **config.codec_params())
    return lambda n: footprint(stream_sizes(codec, shape, n))


def test_auto_arena_is_the_pools_streams_in_the_mode_rounded_to_mib() -> None:
    lynx, int4 = LynxConfig(), LynxConfig(mode="lynx-int4")
    size = size_arena(lynx, "receive", _footprint(lynx), pool_tokens=16384, max_request_tokens=8192)
    pool_bytes = _footprint(lynx)(16384)
    assert size.auto and size.field == "receive_arena_mb" and size.pool_bytes == pool_bytes
    assert size.arena_bytes == -(-pool_bytes // MIB) * MIB and size.arena_bytes % MIB == 0
    # ~8.5 bits/value (anchor + residual on the wire + metadata): 2 x 30 x 3 x 64 values/token -> ~12.2 KB/token
    assert 12_000 * 16384 < pool_bytes < 12_500 * 16384
    anchor_only = size_arena(int4, "send", _footprint(int4), pool_tokens=16384, max_request_tokens=8192)
    assert anchor_only.field == "send_arena_mb" and anchor_only.arena_bytes < 0.6 * size.arena_bytes  # no residual
    bigger_model = size_arena(lynx, "send", _footprint(lynx, KVShape(32, 8, 128)), 65536, 8192)
    assert 69_000 * 65536 < bigger_model.pool_bytes < 70_500 * 65536  # 8B-like GQA: ~70 KB/token ...
    assert bigger_model.arena_bytes == lynx.arena_cap_mb * MIB  # ... so a 64K-token pool is capped at 2 GiB


def test_auto_is_capped_and_the_cap_must_hold_one_max_context_request() -> None:
    config = LynxConfig(arena_cap_mb=64)
    fp = _footprint(config)
    size = size_arena(config, "receive", fp, pool_tokens=16384, max_request_tokens=2048)
    assert size.arena_bytes == 64 * MIB and size.max_request_bytes == fp(2048)
    with pytest.raises(LynxConfigError, match=r"receive_arena_mb.*arena_cap_mb=64.*8192 tokens need 96 MiB"):
        size_arena(config, "receive", fp, pool_tokens=16384, max_request_tokens=8192)
    # the longest request is at most the pool
    assert size_arena(config, "send", fp, pool_tokens=4096, max_request_tokens=1 << 20).max_request_bytes == fp(4096)


def test_an_explicit_size_is_used_as_given_but_must_hold_one_max_context_request() -> None:
    fp = _footprint(LynxConfig())
    size = size_arena(LynxConfig(send_arena_mb=30), "send", fp, pool_tokens=16384, max_request_tokens=2048)
    assert not size.auto and size.arena_bytes == 30 * MIB
    big = size_arena(LynxConfig(send_arena_mb=4096), "send", fp, pool_tokens=16384, max_request_tokens=2048)
    assert big.arena_bytes == 4096 * MIB  # the cap bounds "auto" only
    with pytest.raises(LynxConfigError, match=r"send_arena_mb: 20 MiB cannot hold one max-context request "
                                              r"\(2048 tokens need 24 MiB.*at least 24"):
        size_arena(LynxConfig(send_arena_mb=20), "send", fp, pool_tokens=16384, max_request_tokens=2048)


def test_arena_fields_are_validated() -> None:
    assert LynxConfig.parse('{"send_arena_mb": 64, "receive_arena_mb": "auto"}').send_arena_mb == 64
    for bad, match in (({"send_arena_mb": "big"}, "send_arena_mb: expected an integer \\(MiB\\) or 'auto'"),
                       ({"receive_arena_mb": 0}, "receive_arena_mb: 0 is out of range"),
                       ({"receive_arena_mb": 1.5}, "receive_arena_mb: expected"),
                       ({"arena_cap_mb": "auto"}, "arena_cap_mb: expected an integer")):
        with pytest.raises(LynxConfigError, match=match):
            LynxConfig.from_dict(bad)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fifo_turns_a_waiting_request_is_served_first_and_small_ones_do_not_jump_it() -> None:
    clock = Clock()
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64, clock=clock, size_field="receive_arena_mb")
    assert alloc.try_allocate_in_turn("a", {A: 6000}) is not None
    assert alloc.try_allocate_in_turn("b", {A: 6000}) is None  # queued: no room
    assert alloc.try_allocate_in_turn("c", {A: 1000}) is None  # would fit, but b is ahead (FIFO)
    assert alloc.stats()["waiting"] == 2 and alloc.stats()["waits"] == 2
    alloc.release("a")
    assert alloc.try_allocate_in_turn("c", {A: 1000}) is None  # still b's turn
    assert alloc.try_allocate_in_turn("b", {A: 6000}) is not None
    assert alloc.try_allocate_in_turn("c", {A: 1000}) is not None
    assert alloc.stats()["waiting"] == 0 and alloc.stats()["leases"] == 2
    # a queued request that stops asking loses its place; a cancelled one leaves at once
    assert alloc.try_allocate_in_turn("d", {A: 9000}) is None
    assert alloc.try_allocate_in_turn("e", {A: 64}) is None
    clock.now += alloc.stale_s + 1
    assert alloc.try_allocate_in_turn("e", {A: 64}) is not None  # d went away: e is served
    alloc.cancel_wait("nobody")
    assert alloc.try_allocate_in_turn("f", {A: 9000}) is None
    alloc.cancel_wait("f")
    assert alloc.stats()["waiting"] == 0


def test_a_request_bigger_than_the_whole_arena_fails_at_once_naming_the_field() -> None:
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64, size_field="send_arena_mb")
    for call in (lambda: alloc.try_allocate_in_turn("huge", {A: 8000, R: 4000}),
                 lambda: alloc.allocate_wait("huge", {A: 8000, R: 4000}, timeout_s=30.0),
                 lambda: alloc.allocate("huge", {A: 8000, R: 4000})):
        t0 = time.monotonic()
        with pytest.raises(StagingTooLargeError, match=r"12032 bytes.*whole arena \(10000 bytes\).*send_arena_mb"):
            call()
        assert time.monotonic() - t0 < 1.0
    assert alloc.stats()["waiting"] == 0


@pytest.mark.timeout(60)
def test_allocate_wait_blocks_in_fifo_order_until_space_is_freed() -> None:
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64)
    alloc.allocate("holder", {A: 9000})
    order: list[str] = []
    errors: list[BaseException] = []

    def wait(name: str, size: int) -> None:
        try:
            alloc.allocate_wait(name, {A: size}, timeout_s=20.0, poll_s=0.05)
            order.append(name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    first = threading.Thread(target=wait, args=("first", 6000))
    first.start()
    deadline = time.monotonic() + 5
    while alloc.stats()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    second = threading.Thread(target=wait, args=("second", 500))  # would fit now, must not overtake
    second.start()
    while alloc.stats()["waiting"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert order == [] and alloc.stats()["waiting"] == 2
    alloc.release("holder")
    first.join(10)
    second.join(10)
    assert not errors and order == ["first", "second"] and alloc.stats()["waiting"] == 0


def test_allocate_wait_gives_up_after_its_timeout_with_a_clear_reason() -> None:
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64, size_field="send_arena_mb")
    alloc.allocate("holder", {A: 9000})
    t0 = time.monotonic()
    with pytest.raises(StagingFullError, match=r"waited 0 s \(transfer_timeout_s\).*send_arena_mb.*stayed full"):
        alloc.allocate_wait("late", {A: 5000}, timeout_s=0.3, poll_s=0.05)
    assert 0.25 < time.monotonic() - t0 < 5 and alloc.stats()["waiting"] == 0
