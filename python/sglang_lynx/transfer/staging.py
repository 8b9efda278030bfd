"""Decode-side staging allocator: one registered arena, per-request regions for anchor + residual.

Lifecycle of a request's region (explicit :class:`LeaseState`)::

    allocate() -> ACTIVE --release()------------------------------------> freed (reusable at once)
                        \\--quarantine(hold_s)-> QUARANTINED --sender_quiet() or hold expires--> freed

- ``release`` is for the success path: every stream landed, was verified and consumed; no write to it
  can still be in flight, so the bytes are reusable immediately.
- ``quarantine`` is for failure, timeout and abort: after a failed Mooncake batch, entries already
  admitted keep writing into the remote buffer (mooncake-tcp.md), so the region is NOT reused until the
  sender says it is quiet (``sender_quiet``; at once if it said so before the failure) or ``hold_s``
  has passed. No later request can be handed a quarantined byte: that is the invariant the tests check.

A request that does not fit the free space *waits its turn* (FIFO) instead of failing:

    wait queue: try_allocate_in_turn() -> None (queued) ... -> lease (its turn, and it fits)
                allocate_wait(timeout_s) blocks the same way; cancel_wait() leaves the queue

Only the head of the queue is served, so a large request is not starved by small ones behind it; a
queued request that stops asking for ``stale_s`` (its caller went away) loses its place. A request
larger than the whole arena can never fit: :class:`StagingTooLargeError` at once, naming the config
field that sizes the arena (``size_field``). Plain ``allocate`` does not wait (and does not queue).

The allocator is pure bookkeeping over integers (the caller owns and registers the arena memory); it is
thread-safe (one lock) and takes a ``clock`` so tests control time. Regions are aligned to
``alignment`` bytes; free extents are kept sorted and coalesced.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_lynx.transfer.arena_size import too_large_message
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion, TransferMetadataError


class StagingFullError(RuntimeError):
    """No free staging region is large enough right now (try again after releases)."""


class StagingTooLargeError(StagingFullError):
    """The request is larger than the whole arena: it can never fit (the message names the config field)."""


class LeaseState(enum.Enum):
    ACTIVE = "active"
    QUARANTINED = "quarantined"
    FREED = "freed"


@dataclass
class StagingLease:
    request_id: str
    start: int  # absolute address of the region
    length: int  # bytes reserved (aligned)
    regions: dict[StreamKind, StreamRegion]
    state: LeaseState = LeaseState.ACTIVE
    quarantine_until: float = 0.0
    reason: str = ""
    arena: tuple[int, int] = field(default=(0, 0))
    sender_quiet: bool = False  # the sender said no write can still land (before any quarantine)

    def target(self, session_id: str) -> RemoteTarget:
        """The remote metadata a sender needs to write this request's streams here."""
        return RemoteTarget(session_id, self.arena[0], self.arena[1], dict(self.regions))


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def footprint(sizes: dict[StreamKind, int], alignment: int = 64) -> int:
    """Bytes a request with these stream sizes takes in an arena (each stream aligned)."""
    return sum(_align(max(n, 1), alignment) for n in sizes.values())


class StagingAllocator:
    def __init__(self, arena_addr: int, arena_bytes: int, alignment: int = 64,
                 clock: Callable[[], float] = time.monotonic, size_field: str = "the arena size",
                 stale_s: float = 60.0) -> None:
        if arena_addr <= 0 or arena_bytes <= 0:
            raise TransferMetadataError(f"arena {arena_addr:#x}+{arena_bytes}: must be positive")
        if alignment <= 0 or alignment & (alignment - 1):
            raise TransferMetadataError(f"alignment {alignment} must be a power of two")
        self.arena_addr, self.arena_bytes, self.alignment = arena_addr, arena_bytes, alignment
        self._clock = clock
        self.size_field, self.stale_s = size_field, stale_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when bytes are freed or the queue moves
        self._free: list[tuple[int, int]] = [(arena_addr, arena_bytes)]  # sorted (start, length)
        self._leases: dict[str, StagingLease] = {}
        self._waiting: OrderedDict[str, float] = OrderedDict()  # FIFO: request id -> when it last asked
        self.waits = 0  # requests that had to wait for space (observability, tests)
        self.last_freed = clock()  # when a region was last freed: a queue that waits longer is stuck

    # ----- queries -----
    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

    def lease(self, request_id: str) -> StagingLease | None:
        with self._lock:
            return self._leases.get(request_id)

    def quarantined(self) -> list[str]:
        with self._lock:
            return [r for r, lease in self._leases.items() if lease.state is LeaseState.QUARANTINED]

    def stats(self) -> dict[str, int]:
        """Occupancy for observability and leak checks: idle is ``free_bytes == arena_bytes``, no lease."""
        with self._lock:
            quarantined = sum(1 for x in self._leases.values() if x.state is LeaseState.QUARANTINED)
            return {"arena_bytes": self.arena_bytes, "free_bytes": sum(n for _, n in self._free),
                    "leases": len(self._leases), "quarantined": quarantined, "waiting": len(self._waiting),
                    "waits": self.waits}

    # ----- transitions -----
    def allocate(self, request_id: str, sizes: dict[StreamKind, int]) -> StagingLease:
        """A region now, or :class:`StagingFullError` (no waiting, no queueing)."""
        self._check_sizes(sizes)
        with self._lock:
            self._check_fits_locked(request_id, sizes)
            self._reclaim_expired_locked()
            lease = self._carve_locked(request_id, sizes)
            if lease is not None:
                return lease
            n_q = sum(1 for x in self._leases.values() if x.state is LeaseState.QUARANTINED)
        raise StagingFullError(
            f"staging arena ({self.arena_bytes} bytes) has no free region of {footprint(sizes, self.alignment)} "
            f"bytes for {request_id!r}; {n_q} region(s) quarantined"
        )

    def try_allocate_in_turn(self, request_id: str, sizes: dict[StreamKind, int]) -> StagingLease | None:
        """FIFO, non-blocking: the region if it is this request's turn and it fits, else None (the
        request is queued, or keeps its place; call again later). Never-fitting: StagingTooLargeError."""
        self._check_sizes(sizes)
        with self._lock:
            return self._in_turn_locked(request_id, sizes)

    def allocate_wait(self, request_id: str, sizes: dict[StreamKind, int], timeout_s: float,
                      poll_s: float = 0.2) -> StagingLease:
        """FIFO, blocking: wait up to ``timeout_s`` for this request's turn and space."""
        self._check_sizes(sizes)
        deadline = self._clock() + timeout_s
        with self._lock:
            while True:
                lease = self._in_turn_locked(request_id, sizes)
                if lease is not None:
                    return lease
                remaining = deadline - self._clock()
                if remaining <= 0:
                    ahead = list(self._waiting).index(request_id) if request_id in self._waiting else 0
                    self._leave_queue_locked(request_id)
                    raise StagingFullError(
                        f"waited {timeout_s:.0f} s (transfer_timeout_s) for {footprint(sizes, self.alignment)} "
                        f"bytes of staging for {request_id!r}: the arena ({self.arena_bytes} bytes, "
                        f"{self.size_field}) stayed full ({len(self._leases)} lease(s), {ahead} request(s) ahead)")
                self._changed.wait(min(remaining, poll_s))

    def cancel_wait(self, request_id: str) -> None:
        """The request no longer wants a region (aborted, failed): leave the queue."""
        with self._lock:
            self._leave_queue_locked(request_id)

    def release(self, request_id: str) -> None:
        """Success path: free the region now. Refused for a quarantined region (wait for quiet)."""
        with self._lock:
            lease = self._get_locked(request_id)
            if lease.state is LeaseState.QUARANTINED:
                raise TransferMetadataError(
                    f"release: {request_id!r} is quarantined ({lease.reason}); use sender_quiet()"
                )
            self._free_locked(lease)

    def quarantine(self, request_id: str, reason: str, hold_s: float) -> None:
        """Failure/abort path: keep the region unusable until the sender is quiet or hold_s passes."""
        with self._lock:
            lease = self._get_locked(request_id)
            if lease.sender_quiet:  # nothing can still land: no reason to hold the bytes back
                self._free_locked(lease)
                return
            until = self._clock() + hold_s
            lease.quarantine_until = max(lease.quarantine_until, until)
            lease.state, lease.reason = LeaseState.QUARANTINED, reason

    def sender_quiet(self, request_id: str) -> None:
        """The sender reports that no write to this request can still land: free a quarantined region."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and lease.state is LeaseState.QUARANTINED:
                self._free_locked(lease)
            elif lease is not None:
                lease.sender_quiet = True  # a later failure/abort frees the region at once

    def reclaim_expired(self) -> list[str]:
        with self._lock:
            return self._reclaim_expired_locked()

    # ----- internals (lock held) -----
    @staticmethod
    def _check_sizes(sizes: dict[StreamKind, int]) -> None:
        if not sizes:
            raise TransferMetadataError("allocate: no streams requested")
        for kind, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise TransferMetadataError(f"allocate: {kind.value} size {n!r} must be an int >= 0")

    def _check_fits_locked(self, request_id: str, sizes: dict[StreamKind, int]) -> None:
        if request_id in self._leases:
            raise TransferMetadataError(f"allocate: request {request_id!r} already holds a region")
        need = footprint(sizes, self.alignment)
        if need > self.arena_bytes:
            self._leave_queue_locked(request_id)
            raise StagingTooLargeError(too_large_message(self.size_field, request_id, need, self.arena_bytes))

    def _in_turn_locked(self, request_id: str, sizes: dict[StreamKind, int]) -> StagingLease | None:
        self._check_fits_locked(request_id, sizes)
        now = self._clock()
        if request_id not in self._waiting:
            self._waiting[request_id] = now
            if len(self._waiting) > 1 or self._carve_locked(request_id, sizes, dry_run=True) is None:
                self.waits += 1
        self._waiting[request_id] = now
        while self._waiting:  # a head that stopped asking (its caller went away) loses its place
            head, seen = next(iter(self._waiting.items()))
            if head == request_id or now - seen <= self.stale_s:
                break
            self._leave_queue_locked(head)
        if next(iter(self._waiting)) != request_id:
            return None
        self._reclaim_expired_locked()
        lease = self._carve_locked(request_id, sizes)
        if lease is not None:
            self._leave_queue_locked(request_id)
        return lease

    def _leave_queue_locked(self, request_id: str) -> None:
        if self._waiting.pop(request_id, None) is not None:
            self._changed.notify_all()

    def _carve_locked(self, request_id: str, sizes: dict[StreamKind, int],
                      dry_run: bool = False) -> StagingLease | None:
        offsets: dict[StreamKind, tuple[int, int]] = {}
        total = 0
        for kind in sorted(sizes, key=lambda k: k.value):
            offsets[kind] = (total, sizes[kind])
            total += _align(max(sizes[kind], 1), self.alignment)
        for i, (start, length) in enumerate(self._free):
            if length >= total:
                if dry_run:
                    return StagingLease(request_id, start, total, {})
                if length == total:
                    del self._free[i]
                else:
                    self._free[i] = (start + total, length - total)
                regions = {k: StreamRegion(start + off, n) for k, (off, n) in offsets.items()}
                lease = StagingLease(request_id, start, total, regions, arena=(self.arena_addr, self.arena_bytes))
                self._leases[request_id] = lease
                return lease
        return None

    def _get_locked(self, request_id: str) -> StagingLease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise TransferMetadataError(f"request {request_id!r} holds no staging region")
        return lease

    def _reclaim_expired_locked(self) -> list[str]:
        now = self._clock()
        expired = [r for r, x in self._leases.items()
                   if x.state is LeaseState.QUARANTINED and x.quarantine_until <= now]
        for r in expired:
            self._free_locked(self._leases[r])
        return expired

    def _free_locked(self, lease: StagingLease) -> None:
        lease.state = LeaseState.FREED
        del self._leases[lease.request_id]
        self.last_freed = self._clock()
        self._changed.notify_all()
        i = bisect.bisect_left(self._free, (lease.start, 0))
        self._free.insert(i, (lease.start, lease.length))
        # coalesce with neighbours
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
