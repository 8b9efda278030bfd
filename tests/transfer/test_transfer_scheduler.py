"""Tier (a): the scheduler's ordering, window, failure and shutdown logic against a fake FIFO wire."""

from __future__ import annotations

import time

import pytest
from transfer_fakes import Buffers, FakeWire, fake_target

from sglang_lynx.config import LynxConfig
from sglang_lynx.transfer.progress import StreamFailure, TransferState
from sglang_lynx.transfer.scheduler import SchedulerClosedError, SchedulerParams, TransferScheduler
from sglang_lynx.transfer.streams import StreamKind, checksum_at

KIB = 1 << 10
PARAMS = SchedulerParams(residual_chunk_bytes=64 * KIB, residual_window=2, anchor_chunk_bytes=256 * KIB,
                         anchor_window=4, transfer_timeout_s=5.0)


@pytest.mark.timeout(30)
def test_anchor_behind_residual_backlog_is_issued_next_and_lands_first() -> None:
    wire = FakeWire(bytes_per_s=4 * 1024 * KIB)  # 64 KiB chunk = ~16 ms
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        big = sched.submit("big", fake_target(0, 64 * KIB, 1024 * KIB),
                           lambda: bufs.encoded(64 * KIB, 1024 * KIB))
        big.anchor.future.result(timeout=5)
        time.sleep(0.08)  # residual backlog of "big" is flowing now
        assert big.residual is not None and big.residual.state is TransferState.IN_FLIGHT
        late = sched.submit("late", fake_target(1, 32 * KIB, 32 * KIB),
                            lambda: bufs.encoded(32 * KIB, 32 * KIB))
        late.anchor.future.result(timeout=5)
        big.residual.future.result(timeout=10)
        late.residual.future.result(timeout=10)  # type: ignore[union-attr]
        log = sched.issue_log
        first_late = next(i for i, e in enumerate(log) if e[0] == "late")
        assert log[first_late][1] is StreamKind.ANCHOR
        # after the late anchor was issued, every remaining "big" residual chunk came after it
        big_res_after = [i for i, e in enumerate(log) if e[0] == "big" and i > first_late]
        assert big_res_after, "the backlog should not have drained before the late anchor arrived"
        # the anchor overtook the backlog: it landed while big's residual was still going
        assert late.anchor.landed_at < big.residual.landed_at
        # it waited at most for the in-flight residual window: of the writes the wire took before the late
        # anchor's, at most residual_window were still running when the anchor was queued (counted on the
        # wire's own clock, so a loaded machine cannot fail it and a backlog-draining scheduler cannot pass)
        late_dst = fake_target(1, 0, 0).regions[StreamKind.ANCHOR].addr
        at = next(i for i, h in enumerate(wire.handles) if h.dst == late_dst)
        ahead = [h for h in wire.handles[:at] if h.finish_at > late.anchor.queued_at]
        assert len(ahead) <= PARAMS.residual_window, f"{len(ahead)} writes ahead of the late anchor"
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_residual_window_bound_respected_and_no_residual_while_anchor_on_wire() -> None:
    wire = FakeWire(bytes_per_s=8 * 1024 * KIB)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)
    try:
        ts = [sched.submit(f"r{i}", fake_target(i, 128 * KIB, 512 * KIB),
                           lambda: bufs.encoded(128 * KIB, 512 * KIB)) for i in range(4)]
        for t in ts:
            t.residual.future.result(timeout=10)  # type: ignore[union-attr]
    finally:
        sched.close(2)
    res_lo = [(i + 1 << 32) + (1 << 31) for i in range(4)]
    for h in wire.handles:  # at every submit instant, count residual writes outstanding on the wire
        n_res = sum(wire.outstanding_at(h.submitted_at, lo, lo + (1 << 31)) for lo in res_lo)
        assert n_res <= PARAMS.residual_window
        is_anchor = not any(lo <= h.dst < lo + (1 << 31) for lo in res_lo)
        if not is_anchor:  # a residual chunk was issued: no anchor may be outstanding then
            anchors_out = sum(1 for a in wire.handles if a.submitted_at <= h.submitted_at < a.finish_at
                              and not any(lo <= a.dst < lo + (1 << 31) for lo in res_lo))
            assert anchors_out == 0


@pytest.mark.timeout(30)
def test_failures_reach_the_right_object() -> None:
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()
    tgt_bad_res, tgt_bad_anchor, tgt_ok = (fake_target(i, 64 * KIB, 256 * KIB) for i in range(3))
    wire.fail_dst.add(tgt_bad_res.regions[StreamKind.RESIDUAL].addr + 64 * KIB)  # its 2nd residual chunk
    wire.fail_dst.add(tgt_bad_anchor.regions[StreamKind.ANCHOR].addr)
    events = []
    sched = TransferScheduler(wire, PARAMS, on_event=events.append)
    try:
        a = sched.submit("bad-res", tgt_bad_res, lambda: bufs.encoded(64 * KIB, 256 * KIB))
        b = sched.submit("bad-anchor", tgt_bad_anchor, lambda: bufs.encoded(64 * KIB, 256 * KIB))
        c = sched.submit("ok", tgt_ok, lambda: bufs.encoded(64 * KIB, 256 * KIB))
        assert a.anchor.future.result(timeout=5).total_bytes == 64 * KIB
        with pytest.raises(StreamFailure) as err:
            a.residual.future.result(timeout=5)  # type: ignore[union-attr]
        assert err.value.kind is StreamKind.RESIDUAL and err.value.request_id == "bad-res"
        assert "failed" in err.value.reason
        with pytest.raises(StreamFailure) as err_b:
            b.anchor.future.result(timeout=5)
        assert err_b.value.kind is StreamKind.ANCHOR
        with pytest.raises(StreamFailure, match="anchor stream failed"):
            b.residual.future.result(timeout=5)  # type: ignore[union-attr]
        c.residual.future.result(timeout=5)  # type: ignore[union-attr]
        assert c.anchor.state is TransferState.LANDED
        a.quiet.result(timeout=5)  # every issued chunk of the failed request finished
    finally:
        sched.close(2)
    failed = {(e.request_id, e.kind) for e in events if e.state is TransferState.FAILED}
    assert failed == {("bad-res", StreamKind.RESIDUAL), ("bad-anchor", StreamKind.ANCHOR),
                      ("bad-anchor", StreamKind.RESIDUAL)}


@pytest.mark.timeout(30)
def test_bad_metadata_and_encode_errors_fail_before_any_write() -> None:
    wire = FakeWire(bytes_per_s=64 * 1024 * KIB)
    bufs = Buffers()
    sched = TransferScheduler(wire, PARAMS)

    def broken_codec():
        raise RuntimeError("NaN in layer 3")

    try:
        too_small = sched.submit("small", fake_target(0, 1 * KIB, 1 * KIB),
                                 lambda: bufs.encoded(2 * KIB, 1 * KIB))
        with pytest.raises(StreamFailure, match="does not fit"):
            too_small.anchor.future.result(timeout=5)
        broken = sched.submit("broken", fake_target(1, 4 * KIB, 4 * KIB), broken_codec)
        with pytest.raises(StreamFailure, match="NaN in layer 3"):
            broken.residual.future.result(timeout=5)  # type: ignore[union-attr]
        one = sched.submit("one-stream", fake_target(2, 8 * KIB, 0), lambda: bufs.encoded(8 * KIB, None),
                           progressive=False)
        desc = one.anchor.future.result(timeout=5)
        assert one.residual is None and desc.crc32 == checksum_at(bufs.make(8 * KIB).addr, 8 * KIB)
    finally:
        sched.close(2)
    assert [h.dst for h in wire.handles] == [fake_target(2, 0, 0).regions[StreamKind.ANCHOR].addr]


@pytest.mark.timeout(30)
def test_encode_overlaps_the_wire() -> None:
    """The encoder makes object i+1 while object i is on the wire (the paper's encode/send pipelining).

    Checked by the order of events, not by a makespan: each object takes ~160 ms on the wire and 20 ms to
    encode, so a pipelined scheduler has encoded the next object long before the current one lands, while
    one that waited for the wire would encode each object only after the previous one landed.
    """
    wire = FakeWire(bytes_per_s=1024 * 1024 * KIB / 160)  # 1 MiB = ~160 ms on the wire
    bufs = Buffers()
    encode_s, n = 0.02, 5

    def encode():
        time.sleep(encode_s)
        return bufs.encoded(512 * KIB, 512 * KIB)

    sched = TransferScheduler(wire, PARAMS)
    try:
        ts = [sched.submit(f"o{i}", fake_target(i, 512 * KIB, 512 * KIB), encode) for i in range(n)]
        for t in ts:
            t.residual.future.result(timeout=10)  # type: ignore[union-attr]
    finally:
        sched.close(2)
    landed = [t.residual.landed_at for t in ts]  # type: ignore[union-attr]
    assert landed == sorted(landed), "objects landed out of submission order on a FIFO wire"
    for i in range(1, n):
        assert ts[i].encode_finished_at < landed[i - 1], (
            f"object {i} was encoded only after object {i - 1} landed: no overlap of encode and wire")


@pytest.mark.timeout(30)
def test_shutdown_is_bounded_and_resolves_every_future() -> None:
    wire = FakeWire(bytes_per_s=1.0, hang=True)  # nothing ever finishes
    bufs = Buffers()
    sched = TransferScheduler(wire, SchedulerParams.from_config(LynxConfig(residual_chunk_bytes=64 * KIB)))
    ts = [sched.submit(f"h{i}", fake_target(i, 64 * KIB, 256 * KIB),
                       lambda: bufs.encoded(64 * KIB, 256 * KIB)) for i in range(3)]
    time.sleep(0.1)
    t0 = time.monotonic()
    sched.close(timeout_s=0.5)
    assert time.monotonic() - t0 < 1.5
    for t in ts:
        for s in t.streams.values():
            assert s.state in (TransferState.FAILED, TransferState.CANCELLED)
            with pytest.raises(StreamFailure):
                s.future.result(timeout=0)
        assert not t.quiet.done() or t.in_flight_chunks == 0  # in-flight ones are never called quiet
    assert not ts[0].quiet.done()  # its anchor chunk was on the wire when we gave up
    with pytest.raises(SchedulerClosedError):
        sched.submit("late", fake_target(9, 1, 1), lambda: bufs.encoded(1, 1))


class _CountingWire(FakeWire):
    def __init__(self, bytes_per_s: float) -> None:
        super().__init__(bytes_per_s)
        self.polls = 0

    def poll(self, h):  # type: ignore[no-untyped-def]
        self.polls += 1
        return super().poll(h)


@pytest.mark.timeout(30)
def test_the_sender_backs_off_while_chunks_are_slow_and_a_post_wakes_it_at_once() -> None:
    """While a chunk is on a slow wire and nothing changes, polls back off to ``poll_max_s`` (not one every
    ``poll_interval_s``); a request submitted meanwhile is not kept waiting for the backed-off poll."""
    params = SchedulerParams(residual_chunk_bytes=256 * KIB, residual_window=1, anchor_chunk_bytes=256 * KIB,
                             poll_interval_s=0.0002, poll_max_s=0.4, transfer_timeout_s=10.0)
    wire = _CountingWire(bytes_per_s=256 * KIB / 0.6)  # one 256 KiB chunk: 0.6 s
    bufs = Buffers()
    sched = TransferScheduler(wire, params)
    try:
        slow = sched.submit("slow", fake_target(0, 4 * KIB, 256 * KIB), lambda: bufs.encoded(4 * KIB, 256 * KIB))
        slow.anchor.future.result(timeout=5)
        time.sleep(0.3)  # the residual chunk is on the wire, the poll has backed off
        polls = wire.polls
        submitted = time.monotonic()
        late = sched.submit("late", fake_target(1, 4 * KIB, 4 * KIB), lambda: bufs.encoded(4 * KIB, 4 * KIB))
        late_dst = fake_target(1, 0, 0).regions[StreamKind.ANCHOR].addr
        deadline = time.monotonic() + 5
        while not any(h.dst == late_dst for h in wire.handles) and time.monotonic() < deadline:
            time.sleep(0.001)
        issued = next(h.submitted_at for h in wire.handles if h.dst == late_dst)
        assert issued - submitted < 0.2, f"the late anchor waited {issued - submitted:.3f} s for the sender"
        late.residual.future.result(timeout=10)  # type: ignore[union-attr]
        slow.residual.future.result(timeout=10)  # type: ignore[union-attr]
        # in 0.3 s at one poll per 0.2 ms there would be ~1,500; backing off to 0.4 s leaves a few dozen
        assert polls < 200, f"{polls} polls in 0.3 s of a slow chunk"
    finally:
        sched.close(2)


def test_poll_max_below_the_first_poll_is_refused() -> None:
    with pytest.raises(ValueError, match="poll_max_s"):
        SchedulerParams(poll_interval_s=0.01, poll_max_s=0.001)
