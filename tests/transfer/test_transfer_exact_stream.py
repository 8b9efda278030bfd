"""Tier (a): ``lynx-exact``'s third stream in the scheduler (fake FIFO wire): lowest priority, encoded on
its own thread after anchor and residual are queued, variable size within its region, and its failures
(too big, encode error, anchor lost) fail only what they must."""

from __future__ import annotations

import threading
import time

import pytest
from transfer_fakes import Buffers, FakeWire, fake_target

from sglang_lynx.transfer.progress import EncodedObject, ExactPart, StreamFailure, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.streams import StreamKind

KIB = 1 << 10
PARAMS = SchedulerParams(residual_chunk_bytes=64 * KIB, residual_window=2, anchor_chunk_bytes=64 * KIB,
                         anchor_window=4, transfer_timeout_s=5.0)


def _with_exact(bufs: Buffers, anchor: int, residual: int, exact: int,
                before: threading.Event | None = None) -> EncodedObject:
    def encode_exact() -> ExactPart:
        if before is not None:
            assert before.wait(10)
        return ExactPart.whole(bufs.make(exact, fill=9))

    base = bufs.encoded(anchor, residual)
    return EncodedObject(base.anchor, base.residual, encode_exact)


@pytest.mark.timeout(60)
def test_exact_chunks_go_after_every_queued_residual_and_land_with_their_size() -> None:
    wire = FakeWire(bytes_per_s=2 * 1024 * KIB)  # 64 KiB chunk = ~31 ms: everything is queued early
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        ts = [sched.submit(f"r{i}", fake_target(i, 64 * KIB, 256 * KIB, 512 * KIB),
                           lambda: _with_exact(bufs, 64 * KIB, 256 * KIB, 100 * KIB + 3), exact=True)
              for i in range(3)]
        descs = [t.exact.future.result(timeout=20) for t in ts]  # type: ignore[union-attr]
        assert [d.total_bytes for d in descs] == [100 * KIB + 3] * 3  # the bytes written, not the capacity
        log = list(sched.issue_log)
        kinds = [k for _, k, _ in log]
        last_residual = max(i for i, k in enumerate(kinds) if k is StreamKind.RESIDUAL)
        first_exact = min(i for i, k in enumerate(kinds) if k is StreamKind.EXACT)
        assert last_residual < first_exact, kinds
        assert all(t.residual.landed_at <= t.exact.landed_at for t in ts)  # type: ignore[union-attr]
        for t in ts:
            t.quiet.result(timeout=5)
        assert sched.live() == []
    finally:
        sched.close(2)


@pytest.mark.timeout(60)
def test_the_exact_encode_overlaps_the_residual_and_never_delays_the_next_anchor() -> None:
    wire = FakeWire(bytes_per_s=4 * 1024 * KIB)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    hold = threading.Event()
    try:
        first = sched.submit("first", fake_target(0, 64 * KIB, 256 * KIB, 64 * KIB),
                             lambda: _with_exact(bufs, 64 * KIB, 256 * KIB, 10 * KIB, before=hold), exact=True)
        first.residual.future.result(timeout=10)  # type: ignore[union-attr]  # sent while its exact is held
        second = sched.submit("second", fake_target(1, 64 * KIB, 64 * KIB), lambda: bufs.encoded(64 * KIB, 64 * KIB))
        second.residual.future.result(timeout=10)  # type: ignore[union-attr]  # the encode thread is free
        assert first.exact is not None and first.exact.state is TransferState.WAITING_ENCODE
        assert not first.quiet.done()
        hold.set()
        first.exact.future.result(timeout=10)
        first.quiet.result(timeout=5)
    finally:
        hold.set()
        sched.close(2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("problem", ["too_big", "encode_raises"])
def test_an_exact_stream_that_cannot_go_fails_alone(problem: str) -> None:
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)

    def encode() -> EncodedObject:
        base = bufs.encoded(4 * KIB, 4 * KIB)
        if problem == "too_big":
            return EncodedObject(base.anchor, base.residual, lambda: ExactPart.whole(bufs.make(8 * KIB + 1)))

        def broken() -> ExactPart:
            raise RuntimeError("zstd said no")
        return EncodedObject(base.anchor, base.residual, broken)

    try:
        t = sched.submit("r", fake_target(0, 4 * KIB, 4 * KIB, 8 * KIB), encode, exact=True)
        t.residual.future.result(timeout=5)  # type: ignore[union-attr]
        with pytest.raises(StreamFailure, match="does not fit its region" if problem == "too_big" else "zstd said no"):
            t.exact.future.result(timeout=5)  # type: ignore[union-attr]
        t.quiet.result(timeout=5)
        assert t.anchor.state is TransferState.LANDED
        assert not [h for h in wire.handles if h.dst >= (1 << 32) + (3 << 30)]  # no exact byte written
    finally:
        sched.close(2)


@pytest.mark.timeout(60)
def test_a_failed_anchor_fails_the_residual_and_the_exact_stream() -> None:
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        # the anchor does not fit its region: nothing is sent, every stream fails, the exact is never encoded
        t = sched.submit("r", fake_target(0, 1 * KIB, 4 * KIB, 4 * KIB),
                         lambda: _with_exact(bufs, 4 * KIB, 4 * KIB, 1 * KIB), exact=True)
        for stream in (t.anchor, t.residual, t.exact):
            assert stream is not None
            with pytest.raises(StreamFailure):
                stream.future.result(timeout=5)
        t.quiet.result(timeout=5)
        assert wire.handles == []
    finally:
        sched.close(2)


def test_an_exact_stream_needs_a_residual() -> None:
    sched = TransferScheduler(FakeWire(bytes_per_s=1e9), PARAMS)
    try:
        with pytest.raises(ValueError, match="needs the residual"):
            sched.submit("r", fake_target(0, 1, 1, 1), lambda: Buffers().encoded(1, None), progressive=False,
                         exact=True)
    finally:
        sched.close(2)


@pytest.mark.timeout(60)
def test_close_cancels_an_exact_stream_still_waiting_for_its_encode() -> None:
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    hold = threading.Event()
    t = sched.submit("r", fake_target(0, 4 * KIB, 4 * KIB, 4 * KIB),
                     lambda: _with_exact(bufs, 4 * KIB, 4 * KIB, 1 * KIB, before=hold), exact=True)
    t.residual.future.result(timeout=5)  # type: ignore[union-attr]
    threading.Timer(0.3, hold.set).start()  # the encode returns while close() waits for the thread
    started = time.monotonic()
    sched.close(3)
    assert time.monotonic() - started < 3.5
    assert t.exact is not None and t.exact.state.final


class _ThreadKilled(BaseException):
    """As a crash would: escapes the exact thread's per-request guard (which catches Exception)."""


@pytest.mark.timeout(60)
def test_a_dead_exact_thread_fails_the_exact_streams_it_owed_and_refuses_new_exact_requests() -> None:
    from sglang_lynx.transfer.scheduler import SchedulerUnhealthyError

    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)

    def killer() -> ExactPart:
        raise _ThreadKilled("exact thread crashed")

    def encode() -> EncodedObject:
        base = bufs.encoded(4 * KIB, 4 * KIB)
        return EncodedObject(base.anchor, base.residual, killer)

    try:
        t = sched.submit("r", fake_target(0, 4 * KIB, 4 * KIB, 4 * KIB), encode, exact=True)
        t.residual.future.result(timeout=5)  # type: ignore[union-attr]  # anchor and residual still land
        with pytest.raises(StreamFailure, match="lynx-exact thread stopped"):
            t.exact.future.result(timeout=5)  # type: ignore[union-attr]
        t.quiet.result(timeout=5)
        assert "lynx-exact" in (sched.unhealthy_reason() or "")
        with pytest.raises(SchedulerUnhealthyError):
            sched.submit("next", fake_target(1, 4 * KIB, 4 * KIB, 4 * KIB),
                         lambda: _with_exact(bufs, 4 * KIB, 4 * KIB, 1 * KIB), exact=True)
    finally:
        sched.close(2)


@pytest.mark.timeout(60)
def test_a_request_aborted_during_its_exact_encode_is_quiet_only_once_the_encode_is_over() -> None:
    """Quiet frees the send region: while the exact codec still writes into it, the region stays held."""
    wire = FakeWire(bytes_per_s=1e9)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    hold = threading.Event()
    try:
        t = sched.submit("r", fake_target(0, 4 * KIB, 4 * KIB, 4 * KIB),
                         lambda: _with_exact(bufs, 4 * KIB, 4 * KIB, 1 * KIB, before=hold), exact=True)
        t.residual.future.result(timeout=5)  # type: ignore[union-attr]
        sched.abort(t, "client went away")
        with pytest.raises(StreamFailure, match="client went away"):
            t.exact.future.result(timeout=5)  # type: ignore[union-attr]
        time.sleep(0.3)
        assert not t.quiet.done() and t.encodes_running == 1
        hold.set()
        t.quiet.result(timeout=5)
        assert t.encodes_running == 0 and not [h for h in wire.handles if h.dst >= (1 << 32) + (3 << 30)]
    finally:
        hold.set()
        sched.close(2)
