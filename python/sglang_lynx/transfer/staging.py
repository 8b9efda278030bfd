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

The allocator is pure bookkeeping over integers (the caller owns and registers the arena memory); it is
thread-safe (one lock) and takes a ``clock`` so tests control time. Regions are aligned to
``alignment`` bytes; free extents are kept sorted and coalesced.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion, TransferMetadataError


class StagingFullError(RuntimeError):
    """No free staging region is large enough right now (try again after releases)."""


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


class StagingAllocator:
    def __init__(self, arena_addr: int, arena_bytes: int, alignment: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if arena_addr <= 0 or arena_bytes <= 0:
            raise TransferMetadataError(f"arena {arena_addr:#x}+{arena_bytes}: must be positive")
        if alignment <= 0 or alignment & (alignment - 1):
            raise TransferMetadataError(f"alignment {alignment} must be a power of two")
        self.arena_addr, self.arena_bytes, self.alignment = arena_addr, arena_bytes, alignment
        self._clock = clock
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(arena_addr, arena_bytes)]  # sorted (start, length)
        self._leases: dict[str, StagingLease] = {}

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
                    "leases": len(self._leases), "quarantined": quarantined}

    # ----- transitions -----
    def allocate(self, request_id: str, sizes: dict[StreamKind, int]) -> StagingLease:
        if not sizes:
            raise TransferMetadataError("allocate: no streams requested")
        for kind, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise TransferMetadataError(f"allocate: {kind.value} size {n!r} must be an int >= 0")
        with self._lock:
            if request_id in self._leases:
                raise TransferMetadataError(f"allocate: request {request_id!r} already holds a region")
            self._reclaim_expired_locked()
            offsets: dict[StreamKind, tuple[int, int]] = {}
            total = 0
            for kind in sorted(sizes, key=lambda k: k.value):
                offsets[kind] = (total, sizes[kind])
                total += _align(max(sizes[kind], 1), self.alignment)
            for i, (start, length) in enumerate(self._free):
                if length >= total:
                    if length == total:
                        del self._free[i]
                    else:
                        self._free[i] = (start + total, length - total)
                    regions = {k: StreamRegion(start + off, n) for k, (off, n) in offsets.items()}
                    lease = StagingLease(request_id, start, total, regions,
                                         arena=(self.arena_addr, self.arena_bytes))
                    self._leases[request_id] = lease
                    return lease
            n_q = sum(1 for x in self._leases.values() if x.state is LeaseState.QUARANTINED)
        raise StagingFullError(
            f"staging arena ({self.arena_bytes} bytes) has no free region of {total} bytes for "
            f"{request_id!r}; {n_q} region(s) quarantined"
        )

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
        i = bisect.bisect_left(self._free, (lease.start, 0))
        self._free.insert(i, (lease.start, lease.length))
        # coalesce with neighbours
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
