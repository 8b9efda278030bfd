"""Tier (a): a request streamed in parts while its prefill runs (``TransferScheduler.extend``), on a fake wire."""

from __future__ import annotations

import threading
import time

import pytest
from transfer_fakes import Buffers, FakeWire, fake_target

from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, StreamEvent, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.streams import StreamKind, checksum_at

KIB = 1 << 10
PARAMS = SchedulerParams(residual_chunk_bytes=16 * KIB, residual_window=2, anchor_chunk_bytes=16 * KIB,
                         anchor_window=4, transfer_timeout_s=5.0)
A, R = 96 * KIB, 192 * KIB  # whole streams: 3 parts of 32 KiB anchor / 64 KiB residual each


def part(anchor: LocalBuffer, residual: LocalBuffer, i: int, final: bool) -> EncodedObject:
    spans = {StreamKind.ANCHOR: ((i * A // 3, A // 3),), StreamKind.RESIDUAL: ((i * R // 3, R // 3),)}
    return EncodedObject(anchor, residual, spans=spans, final=final)


def written(wire: FakeWire, lo: int, size: int) -> list[tuple[int, int]]:
    return sorted((h.dst - lo, h.length) for h in wire.handles if lo <= h.dst < lo + size)


@pytest.mark.timeout(30)
def test_parts_send_their_spans_and_the_streams_land_after_the_final_one() -> None:
    wire, bufs = FakeWire(bytes_per_s=64 * 1024 * KIB), Buffers()
    anchor, residual = bufs.make(A, 1), bufs.make(R, 2)
    target = fake_target(0, A, R)
    events: list[StreamEvent] = []
    sched = TransferScheduler(wire, PARAMS, on_event=events.append)
    try:
        t = sched.submit("r", target, lambda: part(anchor, residual, 0, False))
        assert sched.extend(t, lambda: part(anchor, residual, 1, False))
        deadline = time.monotonic() + 5
        while len(wire.handles) < 12 and time.monotonic() < deadline:  # two parts: 2 x (2 + 4) chunks
            time.sleep(0.005)
        time.sleep(0.05)
        assert t.residual is not None
        assert t.anchor.state is not TransferState.LANDED and t.residual.state is not TransferState.LANDED
        assert t.anchor.chunks_done == t.anchor.chunks_total == 4  # all sent so far, yet not landed
        assert sched.extend(t, lambda: part(anchor, residual, 2, True))
        desc = t.anchor.future.result(timeout=5)
        t.residual.future.result(timeout=5)
        t.quiet.result(timeout=5)
        assert desc.total_bytes == A and desc.crc32 == checksum_at(anchor.addr, A)
        a_lo, r_lo = target.regions[StreamKind.ANCHOR].addr, target.regions[StreamKind.RESIDUAL].addr
        assert written(wire, a_lo, A) == [(i * 16 * KIB, 16 * KIB) for i in range(6)]  # each byte once
        assert written(wire, r_lo, R) == [(i * 16 * KIB, 16 * KIB) for i in range(12)]
        assert not sched.extend(t, lambda: part(anchor, residual, 2, True))  # over: refused
        assert not [e for e in events if e.spans is not None]  # no exact stream: no progress to report
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_later_part_anchor_overtakes_an_earlier_part_residual() -> None:
    wire, bufs = FakeWire(bytes_per_s=2 * 1024 * KIB), Buffers()  # 16 KiB chunk = ~8 ms
    anchor, residual = bufs.make(A, 1), bufs.make(R, 2)
    target = fake_target(0, A, R)
    events: list[StreamEvent] = []
    sched = TransferScheduler(wire, PARAMS, on_event=events.append)
    try:
        t = sched.submit("r", target, lambda: part(anchor, residual, 0, False))
        deadline = time.monotonic() + 5
        while not any(h.dst >= target.regions[StreamKind.RESIDUAL].addr for h in wire.handles):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sched.extend(t, lambda: part(anchor, residual, 1, True))
        t.quiet.result(timeout=10)
        r_lo = target.regions[StreamKind.RESIDUAL].addr
        kinds = ["r" if h.dst >= r_lo else "a" for h in wire.handles]
        second = [i for i, h in enumerate(wire.handles) if h.dst < r_lo and h.dst - target.regions[
            StreamKind.ANCHOR].addr >= A // 3]
        # part 1's anchor went out while part 0's residual (4 chunks) was still being sent
        assert second and kinds[: second[0]].count("r") < 4
        assert kinds[second[-1] + 1 :].count("r") > 0
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_part_after_a_failure_is_refused_and_quiet_waits_for_a_running_part() -> None:
    wire, bufs = FakeWire(bytes_per_s=64 * 1024 * KIB), Buffers()
    anchor, residual = bufs.make(A, 1), bufs.make(R, 2)
    sched = TransferScheduler(wire, PARAMS)
    release, started = threading.Event(), threading.Event()

    def slow_part() -> EncodedObject:
        started.set()
        assert release.wait(5)
        return part(anchor, residual, 1, False)

    try:
        t = sched.submit("r", fake_target(0, A, R), lambda: part(anchor, residual, 0, False))
        assert sched.extend(t, slow_part)
        assert started.wait(5)
        sched.abort(t, "the prefill dropped it")
        with pytest.raises(Exception, match="the prefill dropped it"):
            t.anchor.future.result(timeout=5)
        time.sleep(0.05)
        assert not t.quiet.done()  # a part still writes into the send buffers
        calls = []
        assert not sched.extend(t, lambda: calls.append(1) or part(anchor, residual, 2, True))
        release.set()
        t.quiet.result(timeout=5)
        assert calls == []
    finally:
        release.set()
        sched.close(2)


@pytest.mark.timeout(30)
def test_each_part_exact_bytes_go_before_the_final_part_and_the_stream_lands_once_whole() -> None:
    """``lynx-exact`` in parts: a part's exact encode (``ExactPart``) runs after its anchor and residual are
    queued, its span goes on the wire while later parts are still to come, and the exact stream lands only
    after the final part's exact encode, with the checksum of everything written."""
    from sglang_lynx.transfer.progress import ExactPart

    wire, bufs = FakeWire(bytes_per_s=64 * 1024 * KIB), Buffers()
    anchor, residual, exact = bufs.make(A, 1), bufs.make(R, 2), bufs.make(3 * 20 * KIB, 3)
    target = fake_target(0, A, R, 4 * 20 * KIB)
    events: list[StreamEvent] = []
    early: list[StreamEvent] = []  # reported before all their bytes were written (the listener cannot raise)
    e_lo = target.regions[StreamKind.EXACT].addr

    def on_event(event: StreamEvent) -> None:
        if event.spans is not None:  # a part's bytes reported in place only once they are on the wire
            lo = target.regions[event.kind].addr
            on_wire = [(h.dst - lo, h.length) for h in wire.handles if h.reported is WriteStatus.DONE and lo <= h.dst]
            if not all(sum(n for at2, n in on_wire if at <= at2 < at + size) == size for at, size in event.spans):
                early.append(event)
        events.append(event)
    sched = TransferScheduler(wire, PARAMS, on_event=on_event)

    def with_exact(i: int, final: bool) -> EncodedObject:
        base = part(anchor, residual, i, final)

        def encode_exact() -> ExactPart:  # part i wrote exact bytes [20i, 20(i + 1)) KiB
            return ExactPart(LocalBuffer(exact.addr, 20 * KIB * (i + 1)), ((20 * KIB * i, 20 * KIB),))
        return EncodedObject(base.anchor, base.residual, encode_exact, base.spans, final=final)

    try:
        t = sched.submit("r", target, lambda: with_exact(0, False), exact=True)
        assert sched.extend(t, lambda: with_exact(1, False))
        deadline = time.monotonic() + 5
        while len(written(wire, e_lo, 3 * 20 * KIB)) < 4:  # two parts' exact spans: 2 x 2 chunks of 16/4 KiB
            assert time.monotonic() < deadline, written(wire, e_lo, 3 * 20 * KIB)
            time.sleep(0.005)
        time.sleep(0.05)
        assert t.exact is not None and t.exact.state is not TransferState.LANDED  # not closed yet
        assert sched.extend(t, lambda: with_exact(2, True))
        desc = t.exact.future.result(timeout=5)
        t.quiet.result(timeout=5)
        assert desc.total_bytes == 3 * 20 * KIB and desc.crc32 == checksum_at(exact.addr, 3 * 20 * KIB)
        spans = written(wire, e_lo, 3 * 20 * KIB)
        assert sum(n for _, n in spans) == 3 * 20 * KIB and len({at for at, _ in spans}) == len(spans)  # each once
        kinds = [h.dst >= e_lo for h in wire.handles]
        assert kinds.index(True) < len(kinds) - kinds[::-1].index(False) - 1  # exact bytes before the last part's
        reported = sorted((e.kind.value, e.spans) for e in events if e.spans is not None)
        assert reported == sorted([("anchor", ((i * A // 3, A // 3),)) for i in (0, 1)]
                                  + [("residual", ((i * R // 3, R // 3),)) for i in (0, 1)]
                                  + [("exact", ((20 * KIB * i, 20 * KIB),)) for i in (0, 1)])  # not the final part's
        assert not early
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_part_exact_encode_that_fails_fails_the_exact_stream_alone() -> None:
    from sglang_lynx.transfer.progress import ExactPart, StreamFailure

    wire, bufs = FakeWire(bytes_per_s=64 * 1024 * KIB), Buffers()
    anchor, residual, exact = bufs.make(A, 1), bufs.make(R, 2), bufs.make(64 * KIB, 3)
    target = fake_target(0, A, R, 8 * KIB)
    sched = TransferScheduler(wire, PARAMS)

    def with_exact(i: int, final: bool) -> EncodedObject:
        base = part(anchor, residual, i, final)

        def encode_exact() -> ExactPart:  # the first part's already overflows the region
            return ExactPart(LocalBuffer(exact.addr, 16 * KIB * (i + 1)), ((16 * KIB * i, 16 * KIB),))
        return EncodedObject(base.anchor, base.residual, encode_exact, base.spans, final=final)

    try:
        t = sched.submit("r", target, lambda: with_exact(0, False), exact=True)
        assert sched.extend(t, lambda: with_exact(1, False))
        assert sched.extend(t, lambda: with_exact(2, True))
        assert t.exact is not None
        with pytest.raises(StreamFailure, match="does not fit its region"):
            t.exact.future.result(timeout=5)
        t.anchor.future.result(timeout=5)
        t.residual.future.result(timeout=5)  # type: ignore[union-attr]
        t.quiet.result(timeout=5)
        assert not written(wire, target.regions[StreamKind.EXACT].addr, 64 * KIB)
    finally:
        sched.close(2)


@pytest.mark.timeout(30)
def test_a_request_streamed_for_longer_than_the_stall_bound_is_not_stalled() -> None:
    """The watchdog's clock is the last part: a prefill whose parts come 0.7 s apart under a 1 s stall bound
    (1.4 s in all) lands; before, the watchdog failed it 1 s after its first part ("not finished after
    submission"), as it would any prompt prefilled for longer than 3 x transfer_timeout_s + residual_timeout_s."""
    wire, bufs = FakeWire(bytes_per_s=64 * 1024 * KIB), Buffers()
    anchor, residual = bufs.make(A, 1), bufs.make(R, 2)
    sched = TransferScheduler(wire, SchedulerParams(residual_chunk_bytes=16 * KIB, anchor_chunk_bytes=16 * KIB,
                                                    transfer_timeout_s=0.5, stall_timeout_s=1.0))
    try:
        t = sched.submit("slow-prefill", fake_target(0, A, R), lambda: part(anchor, residual, 0, False))
        for i in (1, 2):
            time.sleep(0.7)  # the next chunk's prefill
            assert sched.extend(t, lambda i=i: part(anchor, residual, i, i == 2))
        assert t.residual is not None
        assert t.anchor.future.result(timeout=5).total_bytes == A
        t.residual.future.result(timeout=5)
        t.quiet.result(timeout=5)
    finally:
        sched.close(2)
