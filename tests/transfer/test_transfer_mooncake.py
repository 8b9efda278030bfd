"""Tier (b): two processes exchanging anchor + residual streams through the REAL Mooncake engine.

The pytest process is the prefill-side sender (or, for the sender-death tests, the decode-side
receiver); the other end is a spawned child on 127.0.0.1 (tests/transfer/mooncake_peers.py).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mooncake_peers import pattern_buffer, receiver_main, sender_main

from sglang_lynx.transfer.mooncake_engine import MooncakeEngine, mooncake_available
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, StreamFailure, TransferState
from sglang_lynx.transfer.receiver import InboundState, ReceiveTracker
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.staging import StagingAllocator
from sglang_lynx.transfer.streams import RemoteTarget, StreamDescriptor, StreamKind

pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine does not import here")]
MIB = 1 << 20
CTX = mp.get_context("spawn")


class Receiver:
    """A receiver child process and its control pipe."""

    def __init__(self, arena_bytes: int) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=receiver_main, args=(child, arena_bytes), daemon=True)
        self.proc.start()
        msg = self.recv(60)
        assert msg[0] == "ready", msg
        self.session_id = msg[1]

    def recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"receiver child said nothing for {timeout_s} s")
        return self.conn.recv()

    def expect(self, rid: str, anchor: int, residual: int, timeout_s: float = 60) -> RemoteTarget:
        self.conn.send(("expect", rid, {"anchor": anchor, "residual": residual}, timeout_s))
        msg = self.recv(10)
        assert msg[:2] == ("target", rid), msg
        return RemoteTarget.from_dict(msg[2])

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
            self.proc.kill()
        self.proc.join(10)


class Sender:
    """The pytest process's engine + scheduler; events go to a queue (the pipe is single-threaded)."""

    def __init__(self, engine: MooncakeEngine, timeout_s: float = 30.0, engine_wrapper: Any = None) -> None:
        self.engine, self.events = engine, queue.Queue()  # type: ignore[var-annotated]
        self.keep: list[Any] = []
        params = SchedulerParams(residual_chunk_bytes=4 * MIB, residual_window=2,
                                 transfer_timeout_s=timeout_s)
        self.sched = TransferScheduler(engine_wrapper or engine, params, on_event=self.events.put)

    def obj(self, anchor: int, residual: int, seed: int) -> EncodedObject:
        bufs = [pattern_buffer(anchor, seed), pattern_buffer(residual, seed + 100)]
        for b, n in zip(bufs, (anchor, residual), strict=True):
            self.engine.register(ctypes.addressof(b), n)
        self.keep.extend(bufs)
        return EncodedObject(LocalBuffer(ctypes.addressof(bufs[0]), anchor),
                             LocalBuffer(ctypes.addressof(bufs[1]), residual))

    def close(self) -> None:
        self.sched.close(10)
        for b in self.keep:
            self.engine.unregister(ctypes.addressof(b))


@pytest.fixture(scope="module")
def engine() -> Iterator[MooncakeEngine]:
    eng = MooncakeEngine.start("127.0.0.1")
    yield eng
    eng.close()


def forward_and_verify(sender: Sender, receiver: Receiver, n_streams: int) -> dict[tuple[str, str], tuple]:
    """Forward landed notices to the receiver; return its verdicts keyed by (request, stream)."""
    verdicts: dict[tuple[str, str], tuple] = {}
    while len(verdicts) < n_streams:
        ev = sender.events.get(timeout=30)
        if ev.state is TransferState.LANDED:
            receiver.conn.send(("landed", ev.descriptor.to_dict()))
            msg = receiver.recv(10)
            verdicts[(msg[1], msg[2])] = msg
        else:
            verdicts[(ev.request_id, ev.kind.value)] = ("sender-failed", ev.request_id, ev.kind.value,
                                                        ev.state.value, str(ev.error), 0.0)
    return verdicts


@pytest.mark.timeout(120)
def test_bytes_verified_and_anchor_overtakes_residual_backlog(engine: MooncakeEngine) -> None:
    receiver, sender = Receiver(400 * MIB), Sender(engine)
    try:
        objs = [sender.obj(1 * MIB, 96 * MIB, i) for i in range(3)]  # built up front: encode is instant
        late_obj, late_tgt = sender.obj(1 * MIB, 1 * MIB, 9), receiver.expect("late", 1 * MIB, 1 * MIB)
        backlog = []
        for i in range(3):
            tgt = receiver.expect(f"bulk{i}", 1 * MIB, 96 * MIB)
            backlog.append(sender.sched.submit(f"bulk{i}", tgt, lambda o=objs[i]: o))
        deadline = time.monotonic() + 30
        while backlog[0].residual.state is not TransferState.IN_FLIGHT:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        late = sender.sched.submit("late", late_tgt, lambda: late_obj)
        verdicts = forward_and_verify(sender, receiver, 8)
    finally:
        sender.close()
        receiver.stop()
    assert all(v[3] == "landed" for v in verdicts.values()), verdicts  # every crc32 matched at the receiver
    last_bulk = max(t.residual.landed_at for t in backlog)  # type: ignore[union-attr]
    assert late.anchor.landed_at < last_bulk, "the late anchor waited behind the whole residual backlog"
    assert late.anchor.landed_at - late.anchor.queued_at < 1.0


@pytest.mark.timeout(120)
def test_corrupted_chunk_is_detected_by_checksum(engine: MooncakeEngine) -> None:
    receiver = Receiver(32 * MIB)

    class CorruptSecondResidualChunk:
        """Corruption in transit: the 2nd residual chunk's bytes come from a decoy buffer."""

        def __init__(self, inner: MooncakeEngine, bad_dst: int) -> None:
            self.inner, self.bad_dst = inner, bad_dst
            self.decoy = pattern_buffer(4 * MIB, 77)
            inner.register(ctypes.addressof(self.decoy), 4 * MIB)

        def submit_write(self, peer: str, src: int, dst: int, n: int, deadline_s: float = 60.0) -> Any:
            if dst == self.bad_dst:
                src = ctypes.addressof(self.decoy)
            return self.inner.submit_write(peer, src, dst, n, deadline_s)

        def poll(self, handle: Any) -> Any:
            return self.inner.poll(handle)

        def settled(self, handle: Any) -> bool:
            return self.inner.settled(handle)

    try:
        tgt = receiver.expect("corrupt", 1 * MIB, 12 * MIB)
        wrapper = CorruptSecondResidualChunk(engine, tgt.regions[StreamKind.RESIDUAL].addr + 4 * MIB)
        sender = Sender(engine, engine_wrapper=wrapper)
        sender.sched.submit("corrupt", tgt, lambda: sender.obj(1 * MIB, 12 * MIB, 3))
        verdicts = forward_and_verify(sender, receiver, 2)
        sender.close()
        engine.unregister(ctypes.addressof(wrapper.decoy))
    finally:
        receiver.stop()
    assert verdicts[("corrupt", "anchor")][3] == "landed"
    assert verdicts[("corrupt", "residual")][3] == "failed"
    assert "checksum mismatch" in verdicts[("corrupt", "residual")][4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_sender_learns_when_receiver_dies_or_hangs(engine: MooncakeEngine, how: str) -> None:
    receiver = Receiver(300 * MIB)
    sender = Sender(engine, timeout_s=2.0)
    try:
        tgt = receiver.expect("victim", 1 * MIB, 256 * MIB)
        t = sender.sched.submit("victim", tgt, lambda: sender.obj(1 * MIB, 256 * MIB, 5))
        deadline = time.monotonic() + 30
        while t.residual.state is not TransferState.IN_FLIGHT:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        os.kill(receiver.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)  # type: ignore[arg-type]
        t_fault = time.monotonic()
        with pytest.raises(StreamFailure) as err:
            t.residual.future.result(timeout=10)  # type: ignore[union-attr]
        learned = time.monotonic() - t_fault
        if how == "stop":  # abandoned writes may still land: not quiet until Mooncake finishes them
            assert not t.quiet.done() and t.abandoned_chunks >= 1
            os.kill(receiver.proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
            t.quiet.result(timeout=20)  # the resumed receiver takes the writes: Mooncake reports them
            assert sender.sched.abandoned.settled_count >= 1 and sender.sched.abandoned.forgotten == 0
    finally:
        receiver.stop()
        sender.close()
    assert err.value.kind is StreamKind.RESIDUAL and err.value.request_id == "victim"
    assert t.anchor.state is TransferState.LANDED
    bound = 5.0 if how == "kill" else 2.0 + 3.0  # kill: Mooncake reports -1; stop: our 2 s deadline
    assert learned < bound, f"{how}: learned after {learned:.2f} s"
    if how == "stop":
        assert "timed_out" in err.value.reason


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_receiver_learns_when_sender_dies_or_hangs(engine: MooncakeEngine, how: str) -> None:
    arena = (ctypes.c_char * (300 * MIB))()
    engine.register(ctypes.addressof(arena), 300 * MIB)
    tracker = ReceiveTracker(StagingAllocator(ctypes.addressof(arena), 300 * MIB), quarantine_s=5.0)
    sizes = {StreamKind.ANCHOR: 1 * MIB, StreamKind.RESIDUAL: 256 * MIB}
    req = tracker.expect("victim", sizes, timeout_s=60.0, residual_timeout_s=2.0)
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=sender_main, args=(child, req.lease.target(engine.session_id).to_dict(),
                                                 1 * MIB, 256 * MIB, 4 * MIB, 2.0), daemon=True)
    proc.start()
    try:
        t_fault = 0.0
        while not req.failed and not req.complete:
            tracker.expire()
            if not conn.poll(0.01):
                continue
            try:
                msg = conn.recv()
            except EOFError:
                tracker.on_sender_lost("control channel closed")
                continue
            if msg[0] == "landed":
                tracker.on_landed(StreamDescriptor.from_dict(msg[1]))
                if req.anchor_landed and not t_fault:  # anchor in: now the sender dies mid-residual
                    os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)  # type: ignore[arg-type]
                    t_fault = time.monotonic()
                    child.close()
        learned = time.monotonic() - t_fault
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)  # type: ignore[arg-type]
            proc.kill()
        proc.join(10)
        engine.unregister(ctypes.addressof(arena))
    assert t_fault, "the anchor never landed"
    assert req.states[StreamKind.ANCHOR] is InboundState.LANDED
    assert req.states[StreamKind.RESIDUAL] is InboundState.FAILED and req.failed_stream is StreamKind.RESIDUAL
    assert ("sender lost" if how == "kill" else "timeout") in req.error
    assert learned < 5.0
    assert tracker.allocator.quarantined() == ["victim"]  # its bytes may still land: not reusable
