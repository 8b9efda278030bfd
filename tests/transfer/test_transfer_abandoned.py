"""Tier (a): writes abandoned at their deadline are held until the engine finishes them or a hold
passes, and the watchdog fails a request stuck outside the wire (fake FIFO wire)."""

from __future__ import annotations

import threading
import time

import pytest
from transfer_fakes import Buffers, FakeWire, fake_target

from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import EncodedObject, RequestTransfer, StreamFailure, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler

KIB = 1 << 10


def _params(**kw: float) -> SchedulerParams:
    base = {"residual_chunk_bytes": 64 * KIB, "anchor_chunk_bytes": 64 * KIB, "transfer_timeout_s": 0.3,
            "abandon_hold_s": 30.0, "stall_timeout_s": 30.0}
    return SchedulerParams(**{**base, **kw})  # type: ignore[arg-type]


def _wait_quiet(t: RequestTransfer, bound_s: float) -> float:
    started = time.monotonic()
    t.quiet.result(timeout=bound_s)
    return time.monotonic() - started


@pytest.mark.timeout(30)
def test_a_timed_out_write_keeps_the_request_busy_until_the_engine_finishes_it() -> None:
    wire = FakeWire(bytes_per_s=64 * KIB)  # the 64 KiB anchor takes 1 s, its deadline is 0.3 s
    bufs = Buffers()
    sched = TransferScheduler(wire, _params())
    try:
        t = sched.submit("slow", fake_target(0, 64 * KIB, 1), lambda: bufs.encoded(64 * KIB, None),
                         progressive=False)
        with pytest.raises(StreamFailure, match="timed_out"):
            t.anchor.future.result(timeout=5)
        assert not t.quiet.done() and t.abandoned_chunks == 1  # the write may still land
        assert [x["request_id"] for x in sched.live()] == ["slow"]
        waited = _wait_quiet(t, 5)
        assert t.abandoned_chunks == 0 and sched.abandoned.settled_count == 1 and sched.abandoned.forgotten == 0
        assert wire.forgotten == []
        assert 0.3 < waited + 0.3 < 2.0  # quiet when the wire finished (~1 s), not at the 30 s hold
        assert sched.live() == []
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_write_the_engine_never_finishes_is_forgotten_after_the_hold() -> None:
    wire = FakeWire(bytes_per_s=1.0, hang=True)
    bufs = Buffers()
    sched = TransferScheduler(wire, _params(abandon_hold_s=0.6))
    try:
        t = sched.submit("stuck", fake_target(0, 64 * KIB, 64 * KIB), lambda: bufs.encoded(64 * KIB, 64 * KIB))
        with pytest.raises(StreamFailure):
            t.anchor.future.result(timeout=5)
        assert t.residual is not None and t.residual.state is TransferState.FAILED  # no anchor, no residual
        assert not t.quiet.done()
        _wait_quiet(t, 5)
        assert sched.abandoned.forgotten == 1 and sched.abandoned.settled_count == 0 and sched.live() == []
        assert len(wire.forgotten) == 1 and wire.forgotten[0].reported is WriteStatus.TIMED_OUT  # engine told too
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_the_watchdog_fails_a_request_whose_encode_never_returns_in_time() -> None:
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, _params(stall_timeout_s=0.5))
    release = threading.Event()
    returned = threading.Event()

    def slow_encode() -> EncodedObject:  # held until the watchdog has failed its request
        release.wait(10)
        returned.set()
        return bufs.encoded(1 * KIB, 1 * KIB)

    try:
        t = sched.submit("stalled", fake_target(0, 1 * KIB, 1 * KIB), slow_encode)
        with pytest.raises(StreamFailure, match="watchdog"):
            t.anchor.future.result(timeout=5)
        time.sleep(0.3)
        # failed, but its codec may still write into its send region: not quiet (the region is not reused)
        assert not t.quiet.done() and t.encodes_running == 1
        # a request queued behind a hung encode would be failed as well (its clock runs from submission):
        # the next one is submitted once the late encode has returned, so it is judged on its own
        release.set()
        assert returned.wait(5)
        _wait_quiet(t, 5)  # nothing was on the wire: quiet once the encode is over
        ok = sched.submit("next", fake_target(1, 1 * KIB, 1 * KIB), lambda: bufs.encoded(1 * KIB, 1 * KIB))
        assert ok.residual is not None
        ok.residual.future.result(timeout=10)  # the late encode result was dropped, the next one flows
        stalled_range = range(1 << 32, 2 << 32)  # fake_target(0, ...)'s remote regions
        assert wire.handles and not [h for h in wire.handles if h.dst in stalled_range]  # nothing of it sent
    finally:
        release.set()
        sched.close(2)


@pytest.mark.timeout(30)
def test_the_watchdog_also_fails_a_request_queued_behind_a_hung_encode() -> None:
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, _params(stall_timeout_s=0.5))
    release = threading.Event()
    try:
        hung = sched.submit("hung", fake_target(0, 1 * KIB, 1 * KIB),
                            lambda: (release.wait(10), bufs.encoded(1 * KIB, 1 * KIB))[1])
        behind = sched.submit("behind", fake_target(1, 1 * KIB, 1 * KIB), lambda: bufs.encoded(1 * KIB, 1 * KIB))
        for t in (hung, behind):
            with pytest.raises(StreamFailure, match="watchdog"):
                t.anchor.future.result(timeout=5)
        assert not wire.handles  # neither reached the wire
    finally:
        release.set()
        sched.close(2)


def test_hold_and_stall_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="abandon_hold_s"):
        _params(abandon_hold_s=0)
    with pytest.raises(ValueError, match="stall_timeout_s"):
        _params(stall_timeout_s=0.1)
