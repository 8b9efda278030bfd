"""Tier (a): the scheduler's threads survive errors. An exception injected into each loop fails the
transfers it owned with the reason and later transfers still land; a thread that dies marks the
scheduler unhealthy and submit refuses with the reason; the issue log is a bounded ring."""

from __future__ import annotations

import time
from typing import Any

import pytest
from transfer_fakes import Buffers, FakeHandle, FakeWire, fake_target

from sglang_lynx.transfer import scheduler as scheduler_module
from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import RequestTransfer, StreamFailure, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, SchedulerUnhealthyError, TransferScheduler
from sglang_lynx.transfer.streams import StreamKind

KIB = 1 << 10
PARAMS = SchedulerParams(residual_chunk_bytes=64 * KIB, residual_window=2, anchor_chunk_bytes=256 * KIB,
                         anchor_window=4, transfer_timeout_s=5.0)


def _send(sched: TransferScheduler, bufs: Buffers, name: str, index: int) -> RequestTransfer:
    return sched.submit(name, fake_target(index, 64 * KIB, 128 * KIB), lambda: bufs.encoded(64 * KIB, 128 * KIB))


def _lands(transfer: RequestTransfer) -> None:
    for stream in transfer.streams.values():
        stream.future.result(timeout=5)
    transfer.quiet.result(timeout=5)


class PollRaises(FakeWire):
    """The engine's poll raises for writes into one address range."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__(bytes_per_s=64 * 1024 * KIB)
        self.lo, self.hi = lo, hi

    def poll(self, h: FakeHandle) -> WriteStatus:
        if self.lo <= h.dst < self.hi:
            raise OSError("engine lost its transfer table")
        return super().poll(h)


@pytest.mark.timeout(30)
def test_an_engine_poll_that_raises_fails_only_that_request() -> None:
    bad = fake_target(1, 0, 0)
    wire = PollRaises(bad.regions[StreamKind.ANCHOR].addr, bad.regions[StreamKind.ANCHOR].addr + (1 << 31))
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        good, broken = _send(sched, bufs, "good", 0), _send(sched, bufs, "broken", 1)
        with pytest.raises(StreamFailure, match="engine lost its transfer table"):
            broken.anchor.future.result(timeout=5)
        with pytest.raises(StreamFailure, match="anchor stream failed"):
            broken.residual.future.result(timeout=5)  # type: ignore[union-attr]
        _lands(good)
        _lands(_send(sched, bufs, "later", 2))
        broken.quiet.result(timeout=5)  # its write settled in the engine: held, then released
        assert sched.health.errors >= 1 and sched.unhealthy_reason() is None
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_an_error_in_the_send_loop_fails_what_it_owned_and_the_loop_goes_on(monkeypatch) -> None:  # noqa: ANN001
    wire = FakeWire(bytes_per_s=1.0, hang=True)  # the first request's chunks stay on the wire
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        stuck = _send(sched, bufs, "stuck", 0)
        deadline = time.monotonic() + 5
        while stuck.anchor.state is not TransferState.IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.005)
        original, calls = sched._watchdog, []

        def broken_watchdog(now: float) -> None:
            calls.append(now)
            if len(calls) == 1:
                raise RuntimeError("watchdog bug")
            original(now)

        sched._next_watchdog = 0.0
        monkeypatch.setattr(sched, "_watchdog", broken_watchdog)
        with pytest.raises(StreamFailure, match="watchdog bug"):
            stuck.anchor.future.result(timeout=5)
        assert not stuck.quiet.done() and stuck.abandoned_chunks == 1  # its bytes may still land
        wire.hang, wire.rate, wire.busy_until = False, 64 * 1024 * KIB, 0.0  # the wire works again
        _lands(_send(sched, bufs, "later", 1))
        assert sched.unhealthy_reason() is None and "watchdog bug" in str(sched.health.last_error)
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_raising_closure_fails_its_own_request_only(monkeypatch) -> None:  # noqa: ANN001
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    original = sched._enqueue

    def enqueue(transfer: RequestTransfer, plan: Any) -> None:
        if transfer.request_id == "victim":
            raise KeyError("corrupt plan")
        original(transfer, plan)

    monkeypatch.setattr(sched, "_enqueue", enqueue)
    try:
        victim, other = _send(sched, bufs, "victim", 0), _send(sched, bufs, "other", 1)
        with pytest.raises(StreamFailure, match="corrupt plan"):
            victim.anchor.future.result(timeout=5)
        victim.quiet.result(timeout=5)  # nothing of it reached the wire
        _lands(other)
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_checksum_that_raises_fails_that_stream_and_the_crc_thread_goes_on(monkeypatch) -> None:  # noqa: ANN001
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()
    poisoned = bufs.encoded(64 * KIB, 128 * KIB)
    real = scheduler_module.checksum_at

    def checksum(addr: int, n: int) -> int:
        if poisoned.residual is not None and addr == poisoned.residual.addr:
            raise MemoryError("cannot map the residual")
        return real(addr, n)

    monkeypatch.setattr(scheduler_module, "checksum_at", checksum)
    sched = TransferScheduler(wire, PARAMS)
    try:
        victim = sched.submit("victim", fake_target(0, 64 * KIB, 128 * KIB), lambda: poisoned)
        victim.anchor.future.result(timeout=5)  # its anchor is fine
        with pytest.raises(StreamFailure, match="crc32 failed.*cannot map the residual"):
            victim.residual.future.result(timeout=5)  # type: ignore[union-attr]
        _lands(_send(sched, bufs, "later", 1))
    finally:
        sched.close(2)


class ThreadKiller(BaseException):
    """Escapes every ``except Exception``: the thread it is raised in ends."""


@pytest.mark.timeout(30)
def test_a_dead_crc_thread_fails_the_waiting_streams_and_marks_the_scheduler_unhealthy(monkeypatch) -> None:  # noqa: ANN001
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()

    def checksum(addr: int, n: int) -> int:
        raise ThreadKiller("crc thread killed")

    monkeypatch.setattr(scheduler_module, "checksum_at", checksum)
    sched = TransferScheduler(wire, PARAMS)
    try:
        victim = _send(sched, bufs, "victim", 0)
        with pytest.raises(StreamFailure, match="lynx-crc thread stopped.*crc thread killed"):
            victim.anchor.future.result(timeout=5)
        victim.quiet.result(timeout=5)
        reason = sched.unhealthy_reason()
        assert reason is not None and "lynx-crc" in reason
        with pytest.raises(SchedulerUnhealthyError, match="lynx-crc thread stopped"):
            _send(sched, bufs, "later", 1)
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_dead_sender_thread_fails_every_transfer_it_owned(monkeypatch) -> None:  # noqa: ANN001
    wire = FakeWire(bytes_per_s=1.0, hang=True)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        stuck = _send(sched, bufs, "stuck", 0)
        deadline = time.monotonic() + 5
        while stuck.anchor.state is not TransferState.IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.005)

        def killer(now: float) -> None:
            raise ThreadKiller("sender killed")

        sched._next_watchdog = 0.0
        monkeypatch.setattr(sched, "_watchdog", killer)
        with pytest.raises(StreamFailure, match="lynx-send thread stopped.*sender killed"):
            stuck.residual.future.result(timeout=5)  # type: ignore[union-attr]
        assert "lynx-send" in str(sched.unhealthy_reason())
        with pytest.raises(SchedulerUnhealthyError):
            _send(sched, bufs, "later", 1)
    finally:
        sched.close(1)


@pytest.mark.timeout(30)
def test_the_issue_log_is_a_bounded_ring(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(scheduler_module, "ISSUE_LOG_ENTRIES", 5)
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()
    sched = TransferScheduler(wire, SchedulerParams(residual_chunk_bytes=8 * KIB, anchor_chunk_bytes=8 * KIB))
    try:
        t = sched.submit("many", fake_target(0, 64 * KIB, 64 * KIB), lambda: bufs.encoded(64 * KIB, 64 * KIB))
        _lands(t)
    finally:
        sched.close(2)
    assert len(wire.handles) == 16 and len(sched.issue_log) == 5  # 16 chunks issued, the last 5 kept
    last = fake_target(0, 0, 0).regions[StreamKind.RESIDUAL].addr + 56 * KIB
    assert sched.issue_log[-1] == ("many", StreamKind.RESIDUAL, last)


class DeadPeerWire(FakeWire):
    """One FIFO lane per peer; writes to ``dead`` never finish (a hung decode server)."""

    def __init__(self, bytes_per_s: float, dead: str) -> None:
        super().__init__(bytes_per_s)
        self.dead = dead
        self.lanes: dict[str, float] = {}

    def submit_write(self, peer: str, local_addr: int, remote_addr: int, length: int,
                     deadline_s: float = 60.0) -> FakeHandle:
        now = time.monotonic()
        with self.lock:
            start = max(now, self.lanes.get(peer, 0.0))
            finish = float("inf") if peer == self.dead else start + length / self.rate
            self.lanes[peer] = finish
            h = FakeHandle(remote_addr, length, now, finish, now + deadline_s)
            self.handles.append(h)
            return h


@pytest.mark.timeout(60)
def test_a_hung_peer_does_not_hold_the_live_peers_transfers() -> None:
    import dataclasses

    wire = DeadPeerWire(64 * 1024 * KIB, dead="hung:1")
    bufs = Buffers()
    params = dataclasses.replace(PARAMS, transfer_timeout_s=30.0, stall_timeout_s=30.0, peer_stall_s=0.3)
    sched = TransferScheduler(wire, params)
    try:
        hung = [sched.submit(f"hung{i}", dataclasses.replace(fake_target(i, 64 * KIB, 128 * KIB), session_id="hung:1"),
                             lambda: bufs.encoded(64 * KIB, 128 * KIB)) for i in range(6)]
        t0 = time.monotonic()
        live = [_send(sched, bufs, f"live{i}", 10 + i) for i in range(4)]
        for transfer in live:  # landed within the stall bound, not at the hung writes' 30 s deadline
            for stream in transfer.streams.values():
                stream.future.result(timeout=5)
        assert time.monotonic() - t0 < 0.3 + 2.0
        assert all(not t.anchor.future.done() for t in hung)  # still waiting for their own deadline
        hung_issued = sum(1 for h in wire.handles if h.finish_at == float("inf"))
        assert hung_issued == PARAMS.anchor_window  # once stalled, no more chunks went to the hung peer
    finally:
        sched.close(1)
