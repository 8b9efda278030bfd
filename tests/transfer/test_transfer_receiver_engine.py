"""ReceiveTracker state machine (pure, fake clock) and the Mooncake wrapper's own checks (real engine)."""

from __future__ import annotations

import ctypes

import pytest

from sglang_lynx.transfer.mooncake_engine import (
    MooncakeCallError,
    MooncakeEngine,
    UnregisteredMemoryError,
    WriteStatus,
    apply_env_defaults,
    mooncake_available,
)
from sglang_lynx.transfer.receiver import InboundState, ReceiveTracker
from sglang_lynx.transfer.staging import StagingAllocator, StagingFullError
from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind, checksum

A, R, X = StreamKind.ANCHOR, StreamKind.RESIDUAL, StreamKind.EXACT


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def make_tracker(clock: Clock, memory: dict[int, bytes]) -> ReceiveTracker:
    return ReceiveTracker(StagingAllocator(1 << 20, 4096, clock=clock), quarantine_s=10.0, clock=clock,
                          checksum_fn=lambda addr, n: checksum(memory.get(addr, b"")[:n]))


def test_tracker_lands_verifies_times_out_and_quarantines() -> None:
    clock, memory = Clock(), {}
    tracker = make_tracker(clock, memory)
    ok = tracker.expect("ok", {A: 100, R: 200}, timeout_s=5.0, residual_timeout_s=1.0)
    memory[ok.lease.regions[A].addr] = b"a" * 100
    tracker.on_landed(StreamDescriptor("ok", A, 100, 64, checksum(b"a" * 100)))
    assert ok.anchor_landed and not ok.complete and ok.deadline == 1.0  # residual clock started
    clock.t = 1.5
    assert tracker.expire() == ["ok"]
    assert ok.states == {A: InboundState.LANDED, R: InboundState.FAILED} and "timeout" in ok.error
    # a late landed notice after the timeout is not trusted
    memory[ok.lease.regions[R].addr] = b"r" * 200
    tracker.on_landed(StreamDescriptor("ok", R, 200, 64, checksum(b"r" * 200)))
    assert ok.states[R] is InboundState.FAILED and tracker.allocator.quarantined() == ["ok"]

    bad = tracker.expect("bad", {A: 100, R: 200}, timeout_s=5.0)
    memory[bad.lease.regions[A].addr] = b"x" * 100
    tracker.on_landed(StreamDescriptor("bad", A, 100, 64, checksum(b"y" * 100)))
    assert bad.failed_stream is A and "checksum mismatch" in bad.error and bad.states[R] is InboundState.FAILED
    size = tracker.expect("size", {A: 10}, timeout_s=5.0)
    tracker.on_landed(StreamDescriptor("size", A, 11, 64, 0))
    assert "wrong size" in size.error
    with pytest.raises(StagingFullError):  # quarantined regions are not handed out again
        tracker.expect("more", {A: 4000}, timeout_s=5.0)
    assert set(tracker.on_sender_lost("gone")) == set()  # nothing unfinished left
    tracker.on_sender_quiet("ok")
    tracker.finish("ok")
    assert "ok" not in tracker.allocator.quarantined()


def test_an_exact_stream_lands_with_the_senders_size_up_to_its_region() -> None:
    clock, memory = Clock(), {}
    tracker = make_tracker(clock, memory)
    req = tracker.expect("x", {A: 100, R: 200, X: 300}, timeout_s=5.0, residual_timeout_s=1.0)
    for kind, data in ((A, b"a" * 100), (R, b"r" * 200), (X, b"e" * 123)):
        memory[req.lease.regions[kind].addr] = data
        tracker.on_landed(StreamDescriptor("x", kind, len(data), 64, checksum(data)))
    assert req.complete and req.landed_bytes == {A: 100, R: 200, X: 123}

    big = tracker.expect("big", {A: 10, R: 10, X: 30}, timeout_s=5.0)
    memory[big.lease.regions[A].addr] = b"a" * 10
    tracker.on_landed(StreamDescriptor("big", A, 10, 64, checksum(b"a" * 10)))
    tracker.on_landed(StreamDescriptor("big", X, 31, 64, 0))
    assert big.failed_stream is X and "region holds 30" in big.error
    clock.t = 0.5
    late = tracker.expect("late", {A: 10, R: 10, X: 30}, timeout_s=5.0, residual_timeout_s=1.0)
    memory[late.lease.regions[A].addr] = b"a" * 10
    tracker.on_landed(StreamDescriptor("late", A, 10, 64, checksum(b"a" * 10)))
    clock.t = 2.0  # the residual timeout covers the exact stream too
    assert tracker.expire() == ["late"] and late.failed and "timeout" in late.error
    lost = tracker.expect("lost", {A: 10, R: 10, X: 30}, timeout_s=5.0)
    tracker.abort("lost")
    assert lost.states == {A: InboundState.FAILED, R: InboundState.FAILED, X: InboundState.FAILED}


def test_env_defaults_do_not_override_user_values() -> None:
    env = {"MC_LOG_LEVEL": "INFO"}
    apply_env_defaults(env)
    assert env["MC_LOG_LEVEL"] == "INFO" and env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "8192"
    with pytest.raises(Exception, match="MC_LOG_DIR"):
        apply_env_defaults({"MC_LOG_DIR": "/tmp"})


@pytest.mark.mooncake
@pytest.mark.timeout(60)
@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine does not import here")
def test_wrapper_refuses_unregistered_source_and_reports_remote_errors() -> None:
    with pytest.raises(ValueError, match="0.0.0.0"):
        MooncakeEngine("0.0.0.0")
    a, b = MooncakeEngine.start("127.0.0.1"), MooncakeEngine.start("127.0.0.1")
    src, dst = (ctypes.c_char * 8192)(), (ctypes.c_char * 8192)()
    ctypes.memset(src, 0x42, 8192)
    try:
        a.register(ctypes.addressof(src), 4096)  # only the first half
        b.register(ctypes.addressof(dst), 8192)
        with pytest.raises(UnregisteredMemoryError):
            a.submit_write(b.session_id, ctypes.addressof(src) + 2048, ctypes.addressof(dst), 4096)
        a.write_sync(b.session_id, ctypes.addressof(src), ctypes.addressof(dst), 4096, deadline_s=10)
        assert dst.raw[:4096] == b"\x42" * 4096 and dst.raw[4096:] == b"\x00" * 4096
        with pytest.raises(MooncakeCallError, match=b.session_id):  # remote address outside its region
            a.write_sync(b.session_id, ctypes.addressof(src), ctypes.addressof(dst) + (1 << 30), 64, deadline_s=10)
        h = a.submit_write(b.session_id, ctypes.addressof(src), ctypes.addressof(dst), 64, deadline_s=10)
        while a.poll(h) is WriteStatus.PENDING:
            pass
        assert h.status is WriteStatus.DONE and a.poll(h) is WriteStatus.DONE  # final; not re-polled
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_streams_checksum_runs_outside_the_tracker_lock() -> None:
    """While one stream's crc32 is being computed, the decode loop (get / expire) and other requests'
    notices go on; a request aborted during its checksum is not marked landed afterwards."""
    import threading

    clock, memory = Clock(), {}
    entered, release = threading.Event(), threading.Event()
    slow_addr: list[int] = []

    def checksum_fn(addr: int, n: int) -> int:
        if addr in slow_addr:
            entered.set()
            assert release.wait(10)
        return checksum(memory.get(addr, b"")[:n])

    tracker = ReceiveTracker(StagingAllocator(1 << 20, 4096, clock=clock), quarantine_s=10.0, clock=clock,
                             checksum_fn=checksum_fn)
    big, small, gone = (tracker.expect(n, {A: 100}, timeout_s=5.0) for n in ("big", "small", "gone"))
    for req, fill in ((big, b"b"), (small, b"s"), (gone, b"g")):
        memory[req.lease.regions[A].addr] = fill * 100
    slow_addr[:] = [big.lease.regions[A].addr, gone.lease.regions[A].addr]
    big_desc = StreamDescriptor("big", A, 100, 64, checksum(b"b" * 100))
    slow = threading.Thread(target=tracker.on_landed, args=(big_desc,))
    slow.start()
    try:
        assert entered.wait(5)
        done = threading.Event()

        def decode_loop() -> None:  # everything the decode side does while the checksum runs
            tracker.expire()
            tracker.get("small")
            tracker.on_landed(StreamDescriptor("small", A, 100, 64, checksum(b"s" * 100)))
            done.set()

        threading.Thread(target=decode_loop).start()
        assert done.wait(5), "the tracker lock was held across another stream's checksum"
        assert small.anchor_landed and not big.anchor_landed
    finally:
        release.set()
        slow.join(5)
    assert big.anchor_landed
    entered.clear()
    release.clear()
    gone_desc = StreamDescriptor("gone", A, 100, 64, checksum(b"g" * 100))
    slow = threading.Thread(target=tracker.on_landed, args=(gone_desc,))
    slow.start()
    assert entered.wait(5)
    tracker.abort("gone", "aborted by the client")
    release.set()
    slow.join(5)
    assert gone.failed and not gone.anchor_landed and "aborted by the client" in gone.error


def test_progress_notices_say_which_bytes_are_in_place_until_the_stream_lands() -> None:
    from sglang_lynx.transfer.control import ControlMessageError, decode_message

    clock, memory = Clock(), {}
    tracker = make_tracker(clock, memory)
    req = tracker.expect("p", {A: 100, R: 200, X: 300}, timeout_s=5.0)
    assert not req.covered(X, 0, 1) and req.covered(X, 5, 5) and req.prefix_in_place(X) == 0
    assert tracker.on_progress("p", X, [(40, 20)]) is req
    assert req.prefix_in_place(X) == 0 and req.covered(X, 40, 60) and not req.covered(X, 39, 60)
    tracker.on_progress("p", X, [(0, 30), (30, 10)])  # joined with [40, 60)
    assert req.in_place[X] == ((0, 60),) and req.prefix_in_place(X) == 60 and req.covered(X, 10, 60)
    assert tracker.on_progress("p", X, [(290, 11)]) is None  # past its region: ignored
    assert tracker.on_progress("nobody", X, [(0, 1)]) is None
    assert not req.covered(A, 0, 10)
    memory[req.lease.regions[X].addr] = b"e" * 123
    tracker.on_landed(StreamDescriptor("p", X, 123, 64, checksum(b"e" * 123)))
    assert req.covered(X, 0, 123) and not req.covered(X, 0, 124) and req.prefix_in_place(X) == 123
    assert tracker.on_progress("p", X, [(0, 1)]) is None  # landed: later notices are late
    tracker.abort("p")
    assert tracker.on_progress("p", A, [(0, 1)]) is None  # failed: not trusted

    ok = decode_message(b'{"type": "progress", "request_id": "1", "stream": "exact", "spans": [[0, 4], [8, 2]]}')
    assert ok["spans"] == [(0, 4), (8, 2)]
    for spans in ("[]", "[[0, 0]]", "[[-1, 4]]", "[[0, 1.5]]", "[[0]]", '"x"', "[[0, true]]",
                  "[" + ", ".join(["[0, 1]"] * 1025) + "]"):
        with pytest.raises(ControlMessageError):
            decode_message(f'{{"type": "progress", "request_id": "1", "stream": "exact", "spans": {spans}}}'.encode())


def test_a_later_stream_failed_before_the_anchor_leaves_the_anchor_awaited_until_its_deadline() -> None:
    clock, memory = Clock(), {}
    tracker = make_tracker(clock, memory)
    early = tracker.expect("early", {A: 10, R: 10, X: 30}, timeout_s=5.0)
    tracker.on_sender_failed("early", X, "exact piece too large")
    assert early.failed and early.states[A] is InboundState.EXPECTED
    memory[early.lease.regions[A].addr] = b"a" * 10
    tracker.on_landed(StreamDescriptor("early", A, 10, 64, checksum(b"a" * 10)))
    assert early.anchor_landed and early.failed_stream is X  # admitted on its anchor, the rest falls back
    late = tracker.expect("late", {A: 10, R: 10, X: 30}, timeout_s=5.0)
    tracker.on_sender_failed("late", X, "exact piece too large")
    clock.t = 6.0
    assert tracker.expire() == ["late"]
    assert late.states[A] is InboundState.FAILED and late.failed_stream is A and "timeout" in late.error
    assert tracker.expire() == []
    lost = tracker.expect("lost", {A: 10, R: 10, X: 30}, timeout_s=50.0)
    tracker.on_sender_failed("lost", R, "residual write failed")
    assert tracker.on_sender_lost("gone") == ["lost"] and lost.states[A] is InboundState.FAILED
