"""Child-process peers for the real-Mooncake tier: a decode-side receiver and a prefill-side sender.

Both talk to the test over a multiprocessing Pipe (the control plane); bytes go through Mooncake.
Times are ``time.monotonic()`` (CLOCK_MONOTONIC, shared by processes on one Linux host).
"""

from __future__ import annotations

import ctypes
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from sglang_lynx.transfer.link import TokenBucketPacer
from sglang_lynx.transfer.mooncake_engine import MooncakeEngine
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, StreamEvent, TransferState
from sglang_lynx.transfer.receiver import ReceiveTracker
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.staging import StagingAllocator
from sglang_lynx.transfer.streams import RemoteTarget, StreamDescriptor, StreamKind


def pattern_buffer(n: int, seed: int) -> ctypes.Array[ctypes.c_char]:
    data = bytes((i * 131 + seed * 17 + (i >> 10)) & 0xFF for i in range(min(n, 1 << 16)))
    buf = (ctypes.c_char * max(n, 1))()
    for off in range(0, n, len(data) or 1):
        k = min(len(data), n - off)
        ctypes.memmove(ctypes.addressof(buf) + off, data, k)
    return buf


def receiver_main(conn: Connection, arena_bytes: int) -> None:
    """Commands: ("expect", rid, {kind: n}, timeout_s) -> ("target", rid, target_dict);
    ("landed", desc_dict) -> ("verified", rid, kind, state, error, t_verified); ("exit",)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine = MooncakeEngine.start("127.0.0.1")
    arena = (ctypes.c_char * arena_bytes)()
    engine.register(ctypes.addressof(arena), arena_bytes)
    tracker = ReceiveTracker(StagingAllocator(ctypes.addressof(arena), arena_bytes), quarantine_s=5.0)
    conn.send(("ready", engine.session_id, os.getpid()))
    while True:
        msg = conn.recv()
        if msg[0] == "expect":
            _, rid, sizes, timeout_s = msg
            req = tracker.expect(rid, {StreamKind(k): v for k, v in sizes.items()}, timeout_s)
            conn.send(("target", rid, req.lease.target(engine.session_id).to_dict()))
        elif msg[0] == "landed":
            desc = StreamDescriptor.from_dict(msg[1])
            req = tracker.on_landed(desc)
            conn.send(("verified", desc.request_id, desc.kind.value, req.states[desc.kind].value,
                       req.error, time.monotonic()))
        elif msg[0] == "exit":
            engine.close()
            conn.send(("bye",))
            return


def sender_main(conn: Connection, target: dict[str, Any], anchor_bytes: int, residual_bytes: int,
                chunk_bytes: int, link_gbps: float) -> None:
    """Send one request through the scheduler over a paced link; forward events over ``conn``."""
    engine = MooncakeEngine.start("127.0.0.1")
    anchor, residual = pattern_buffer(anchor_bytes, 1), pattern_buffer(residual_bytes, 2)
    for buf, n in ((anchor, anchor_bytes), (residual, residual_bytes)):
        engine.register(ctypes.addressof(buf), n)

    def forward(ev: StreamEvent) -> None:
        if ev.state is TransferState.LANDED and ev.descriptor is not None:
            conn.send(("landed", ev.descriptor.to_dict()))
        else:
            conn.send(("failed", ev.request_id, ev.kind.value, str(ev.error)))

    params = SchedulerParams(residual_chunk_bytes=chunk_bytes, residual_window=2, transfer_timeout_s=30.0)
    sched = TransferScheduler(engine, params, pacer=TokenBucketPacer(link_gbps), on_event=forward)
    obj = EncodedObject(LocalBuffer(ctypes.addressof(anchor), anchor_bytes),
                        LocalBuffer(ctypes.addressof(residual), residual_bytes))
    t = sched.submit("victim", RemoteTarget.from_dict(target), lambda: obj)
    conn.send(("submitted", os.getpid()))
    t.residual.future.exception(timeout=60)  # type: ignore[union-attr]
    sched.close(5)
    engine.close()
