"""Decode-side progress of inbound requests: anchor landed, residual (and exact) landed, failed (which
stream, why).

Lifecycle of one inbound request (per-stream :class:`InboundState`)::

    expect() -> EXPECTED --on_landed(desc), crc ok---------> LANDED
                       \\--on_landed(desc), crc/size bad----> FAILED  (checksum mismatch / wrong size)
                        \\--deadline passed (expire())------> FAILED  (timeout)
                         \\--on_sender_lost(reason)---------> FAILED  (peer died / control channel closed)
                          \\--abort()------------------------> FAILED  (aborted)

- ``expect`` allocates the request's staging region (:class:`StagingAllocator`) now; ``try_expect``
  waits its turn in the allocator's FIFO queue (None until then); the sender receives
  ``lease.target(session_id)`` as its remote metadata.
- A landed notice (the sender's :class:`StreamDescriptor`, from the control plane) is trusted only after
  the kind, size and crc32 of the staging bytes match. The ``EXACT`` stream's size is the sender's
  (at most its region: ``sizes`` holds the capacity; ``landed_bytes`` what came). Anchor failure fails
  every other stream too.
- A progress notice (``on_progress``, a part of a request streamed in parts) records which bytes of a
  stream not landed yet are in place (``covered``): a reader may compute from them ahead of the landing,
  never trust them before it (they are not checked by crc32 until then).
- Any failure quarantines the region (writes may still land); ``on_sender_quiet`` or the hold time frees
  it. ``finish`` releases a fully landed request once the decoder has copied its bytes out.
- The tracker never blocks; whoever owns it calls ``expire()`` periodically (the decode loop's poll).
  It is thread-safe (one lock) so a control-plane thread may deliver notices. The crc32 of a landed
  stream (hundreds of MB for a long prompt) is computed OUTSIDE the lock, then published under it
  only if the stream is still expected: the decode loop's ``expire`` / ``get`` and other requests'
  notices never wait for one stream's checksum. The region cannot be reused meanwhile: a request
  failed during its checksum is quarantined (``quarantine_s``, far longer than any checksum), and its
  sender's ``quiet`` notice comes after the ``landed`` one on the same control thread.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_lynx.transfer.staging import StagingAllocator, StagingLease
from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind, checksum_at
from sglang_lynx.transfer.trace import trace


class InboundState(enum.Enum):
    EXPECTED = "expected"
    LANDED = "landed"
    FAILED = "failed"


@dataclass
class InboundRequest:
    request_id: str
    lease: StagingLease
    sizes: dict[StreamKind, int]
    deadline: float
    states: dict[StreamKind, InboundState] = field(default_factory=dict)
    landed_at: dict[StreamKind, float] = field(default_factory=dict)
    residual_timeout_s: float | None = None
    landed_bytes: dict[StreamKind, int] = field(default_factory=dict)
    error: str = ""
    failed_stream: StreamKind | None = None
    # per stream not landed yet: its bytes in place, merged (offset, end) pairs in order (on_progress);
    # replaced whole on each notice, so a reader on another thread sees one consistent tuple
    in_place: dict[StreamKind, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def covered(self, kind: StreamKind, start: int, end: int) -> bool:
        """Are bytes ``[start, end)`` of stream ``kind`` in place (the stream landed, or progress said so)?"""
        if self.states.get(kind) is InboundState.LANDED:
            return 0 <= start <= end <= self.landed_bytes.get(kind, self.sizes[kind])
        return start >= end or any(a <= start and end <= b for a, b in self.in_place.get(kind, ()))

    def prefix_in_place(self, kind: StreamKind) -> int:
        """How many leading bytes of stream ``kind`` are in place."""
        if self.states.get(kind) is InboundState.LANDED:
            return self.landed_bytes.get(kind, self.sizes[kind])
        spans = self.in_place.get(kind, ())
        return spans[0][1] if spans and spans[0][0] == 0 else 0

    @property
    def anchor_landed(self) -> bool:
        return self.states.get(StreamKind.ANCHOR) is InboundState.LANDED

    @property
    def complete(self) -> bool:
        return all(s is InboundState.LANDED for s in self.states.values())

    @property
    def failed(self) -> bool:
        return any(s is InboundState.FAILED for s in self.states.values())


class ReceiveTracker:
    def __init__(self, allocator: StagingAllocator, quarantine_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 checksum_fn: Callable[[int, int], int] = checksum_at) -> None:
        self.allocator, self.quarantine_s = allocator, quarantine_s
        self._clock, self._checksum = clock, checksum_fn
        self._lock = threading.Lock()
        self._requests: dict[str, InboundRequest] = {}

    def expect(self, request_id: str, sizes: dict[StreamKind, int], timeout_s: float,
               residual_timeout_s: float | None = None) -> InboundRequest:
        """Allocate staging; every stream must land within ``timeout_s``, and the residual within
        ``residual_timeout_s`` of the anchor landing (LynxConfig.residual_timeout_s) when given."""
        return self._track(request_id, self.allocator.allocate(request_id, sizes), sizes, timeout_s,
                           residual_timeout_s)

    def try_expect(self, request_id: str, sizes: dict[StreamKind, int], timeout_s: float,
                   residual_timeout_s: float | None = None) -> InboundRequest | None:
        """As ``expect`` when it is this request's turn in the staging queue and it fits; else None (it
        keeps its place: call again). ``StagingTooLargeError`` when it can never fit."""
        lease = self.allocator.try_allocate_in_turn(request_id, sizes)
        return None if lease is None else self._track(request_id, lease, sizes, timeout_s, residual_timeout_s)

    def _track(self, request_id: str, lease: StagingLease, sizes: dict[StreamKind, int], timeout_s: float,
               residual_timeout_s: float | None) -> InboundRequest:
        req = InboundRequest(request_id, lease, dict(sizes), self._clock() + timeout_s,
                             {k: InboundState.EXPECTED for k in sizes}, residual_timeout_s=residual_timeout_s)
        with self._lock:
            self._requests[request_id] = req
        return req

    def tighten_deadline(self, request_id: str, timeout_s: float) -> None:
        """Every stream of the request must now land within ``timeout_s`` (never loosens a deadline)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                req.deadline = min(req.deadline, self._clock() + timeout_s)

    def get(self, request_id: str) -> InboundRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    def active(self) -> int:
        """Requests tracked right now (expected, landed or failed, not yet finished)."""
        with self._lock:
            return len(self._requests)

    def on_landed(self, desc: StreamDescriptor) -> InboundRequest:
        """The sender says ``desc``'s stream has landed: verify size and crc32, then mark it."""
        with self._lock:
            req = self._requests.get(desc.request_id)
            if req is None:
                raise KeyError(f"landed notice for unknown request {desc.request_id!r}")
            if req.states.get(desc.kind) is not InboundState.EXPECTED:
                return req  # late notice after a failure/timeout: the bytes are not trusted
            expected = req.sizes[desc.kind]
            if desc.kind is StreamKind.EXACT and desc.total_bytes > expected:
                self._fail_locked(req, desc.kind, f"wrong size: sender says {desc.total_bytes} bytes, "
                                                  f"the region holds {expected}")
                return req
            if desc.kind is not StreamKind.EXACT and desc.total_bytes != expected:
                self._fail_locked(req, desc.kind, f"wrong size: sender says {desc.total_bytes} bytes, "
                                                  f"expected {expected}")
                return req
            region = req.lease.regions[desc.kind]
        got = self._checksum(region.addr, desc.total_bytes)  # outside the lock (module docstring)
        with self._lock:
            if self._requests.get(desc.request_id) is not req or req.states.get(desc.kind) is not InboundState.EXPECTED:
                return req  # failed, aborted or finished during the checksum: the bytes are not trusted
            if got != desc.crc32:
                self._fail_locked(req, desc.kind, f"checksum mismatch: crc32 {got:#010x} != sender's "
                                                  f"{desc.crc32:#010x}")
                return req
            req.states[desc.kind] = InboundState.LANDED
            req.landed_bytes[desc.kind] = desc.total_bytes
            req.landed_at[desc.kind] = self._clock()
            trace().emit("recv_land", rid=desc.request_id, kind=desc.kind.value, bytes=desc.total_bytes)
            if desc.kind is StreamKind.ANCHOR and req.residual_timeout_s is not None:
                req.deadline = min(req.deadline, req.landed_at[desc.kind] + req.residual_timeout_s)
            return req

    def on_progress(self, request_id: str, kind: StreamKind, spans: list[tuple[int, int]]) -> InboundRequest | None:
        """The sender says bytes ``spans`` ((offset, length)) of a stream are in place; None when the request
        or the stream is not expected any more (a late notice) or a span falls outside the stream's region
        (ignored: the landing's checks decide)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.states.get(kind) is not InboundState.EXPECTED:
                return None
            if any(at < 0 or n < 1 or at + n > req.sizes[kind] for at, n in spans):
                return None
            req.in_place[kind] = _merged((*req.in_place.get(kind, ()), *((at, at + n) for at, n in spans)))
            return req

    def on_sender_failed(self, request_id: str, kind: StreamKind, reason: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                self._fail_locked(req, kind, f"sender reported: {reason}")

    def on_sender_lost(self, reason: str) -> list[str]:
        """The control channel to the sender closed: every unfinished request fails now."""
        with self._lock:
            hit = [r for r in self._requests.values() if not r.complete and _anchor_or_more_awaited(r)]
            for req in hit:
                self._fail_locked(req, self._first_pending(req), f"sender lost: {reason}")
            return [r.request_id for r in hit]

    def on_sender_quiet(self, request_id: str) -> None:
        self.allocator.sender_quiet(request_id)

    def expire(self) -> list[str]:
        """Fail every request whose deadline passed with a stream not landed; return their ids."""
        now = self._clock()
        with self._lock:
            hit = [r for r in self._requests.values() if now > r.deadline and not r.complete
                   and _anchor_or_more_awaited(r)]
            for req in hit:
                self._fail_locked(req, self._first_pending(req), "timeout: stream did not land in time")
        self.allocator.reclaim_expired()
        return [r.request_id for r in hit]

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and not req.failed:
                self._fail_locked(req, self._first_pending(req), reason)

    def finish(self, request_id: str) -> None:
        """Forget a request: release its region if complete (failed ones stay quarantined)."""
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is not None and req.complete:
            self.allocator.release(request_id)

    @staticmethod
    def _first_pending(req: InboundRequest) -> StreamKind:
        for kind in (StreamKind.ANCHOR, StreamKind.RESIDUAL, StreamKind.EXACT):
            if req.states.get(kind) is InboundState.EXPECTED:
                return kind
        return StreamKind.ANCHOR

    def _fail_locked(self, req: InboundRequest, kind: StreamKind, reason: str) -> None:
        if req.failed:
            # already failed (a later stream): only an anchor still expected can fail now, and it takes the rest
            if kind is StreamKind.ANCHOR and req.states.get(kind) is InboundState.EXPECTED:
                for other in req.states:
                    req.states[other] = InboundState.FAILED
                req.error, req.failed_stream = f"{kind.value} stream: {reason}", kind
            return
        req.states[kind] = InboundState.FAILED
        if kind is StreamKind.ANCHOR:
            for other in req.states:
                req.states[other] = InboundState.FAILED
        req.error, req.failed_stream = f"{kind.value} stream: {reason}", kind
        self.allocator.quarantine(req.request_id, req.error, self.quarantine_s)


def _anchor_or_more_awaited(req: InboundRequest) -> bool:
    """Not failed, or failed in a later stream while its anchor is still expected (it may still land)."""
    return not req.failed or req.states.get(StreamKind.ANCHOR) is InboundState.EXPECTED


def _merged(spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """(start, end) pairs sorted, overlapping and adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
