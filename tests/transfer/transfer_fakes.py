"""Test helpers: a fake engine that models one FIFO wire, and real local byte buffers."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion


@dataclass
class FakeHandle:
    dst: int
    length: int
    submitted_at: float
    finish_at: float
    deadline: float
    fail: bool = False
    reported: WriteStatus = WriteStatus.PENDING
    code: int = 0


class FakeWire:
    """Writes finish in submission order at ``bytes_per_s`` (like one Mooncake peer lane, FIFO)."""

    def __init__(self, bytes_per_s: float, hang: bool = False) -> None:
        self.rate, self.hang = bytes_per_s, hang
        self.lock = threading.Lock()
        self.busy_until = 0.0
        self.handles: list[FakeHandle] = []
        self.fail_dst: set[int] = set()  # a write to one of these addresses fails when it "finishes"
        self.max_outstanding_in: dict[str, int] = {}
        self.forgotten: list[FakeHandle] = []  # abandoned writes the scheduler told us to stop watching

    def submit_write(self, peer: str, local_addr: int, remote_addr: int, length: int,
                     deadline_s: float = 60.0) -> FakeHandle:
        now = time.monotonic()
        with self.lock:
            start = max(now, self.busy_until)
            finish = float("inf") if self.hang else start + length / self.rate
            self.busy_until = finish
            h = FakeHandle(remote_addr, length, now, finish, now + deadline_s,
                           fail=remote_addr in self.fail_dst)
            self.handles.append(h)
            return h

    def poll(self, h: FakeHandle) -> WriteStatus:
        assert h.reported is WriteStatus.PENDING, "a finished handle was polled again"
        now = time.monotonic()
        if now >= h.finish_at:
            h.reported = WriteStatus.FAILED if h.fail else WriteStatus.DONE
            h.code = -1 if h.fail else 1
        elif now > h.deadline:
            h.reported = WriteStatus.TIMED_OUT
        return h.reported

    def settled(self, h: FakeHandle) -> bool:
        """The write no longer runs: finished, or reported final (a hung write never settles)."""
        return h.reported in (WriteStatus.DONE, WriteStatus.FAILED) or time.monotonic() >= h.finish_at

    def forget(self, h: FakeHandle) -> None:
        self.forgotten.append(h)

    def outstanding_at(self, t: float, lo: int, hi: int) -> int:
        """Writes into [lo, hi) that were submitted by ``t`` and not yet reported finished by ``t``."""
        return sum(1 for h in self.handles if lo <= h.dst < hi and h.submitted_at <= t < h.finish_at)


class Buffers:
    """Real memory for local buffers (the scheduler checksums them)."""

    def __init__(self) -> None:
        self._keep: list[ctypes.Array[ctypes.c_char]] = []

    def make(self, n: int, fill: int = 7) -> LocalBuffer:
        buf = (ctypes.c_char * max(n, 1))()
        ctypes.memset(buf, fill, n)
        self._keep.append(buf)
        return LocalBuffer(ctypes.addressof(buf), n)

    def encoded(self, anchor: int, residual: int | None, fill: int = 7) -> EncodedObject:
        return EncodedObject(self.make(anchor, fill), None if residual is None else self.make(residual, fill))


def fake_target(index: int, anchor_cap: int, residual_cap: int, exact_cap: int | None = None) -> RemoteTarget:
    """Disjoint fake remote regions: request ``index`` owns [base, base + 2**32) (an exact region from
    base + 3 * 2**30 when ``exact_cap`` is given)."""
    base = (index + 1) << 32
    regions = {StreamKind.ANCHOR: StreamRegion(base, anchor_cap),
               StreamKind.RESIDUAL: StreamRegion(base + (1 << 31), residual_cap)}
    if exact_cap is not None:
        regions[StreamKind.EXACT] = StreamRegion(base + (3 << 30), exact_cap)
    return RemoteTarget("127.0.0.1:1", 1 << 32, 1 << 40, regions)
