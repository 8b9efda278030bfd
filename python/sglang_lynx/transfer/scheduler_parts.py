"""The scheduler's types: engine and pacer contracts, one chunk on the wire, parameters, errors.

``transfer/scheduler.py`` (the :class:`~sglang_lynx.transfer.scheduler.TransferScheduler`) re-exports
everything here; import from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import LocalBuffer, RequestTransfer, StreamProgress
from sglang_lynx.transfer.streams import StreamKind


class EngineLike(Protocol):
    def submit_write(self, peer: str, local_addr: int, remote_addr: int, length: int,
                     deadline_s: float = ...) -> Any: ...

    def poll(self, handle: Any) -> WriteStatus: ...

    def settled(self, handle: Any) -> bool: ...


class PacerLike(Protocol):
    def reserve(self, nbytes: int, now: float) -> float:
        """Book ``nbytes`` on the emulated link; return when (monotonic) they finish crossing it."""
        ...


@dataclass
class _PartSent:
    """The chunks of one part of one stream (a request streamed in parts, ``lynx-exact``): once the last
    of them is done, the scheduler emits a progress event with the part's ``spans`` (offset, length in
    the stream), so the receiver may use those bytes before the stream lands."""

    spans: tuple[tuple[int, int], ...]
    remaining: int


@dataclass
class _Chunk:
    transfer: RequestTransfer
    stream: StreamProgress
    peer: str
    src: int
    dst: int
    length: int
    handle: Any = None
    emulated_finish: float = 0.0
    engine_done: bool = False
    issued_at: float = 0.0  # monotonic, when handed to the engine (the trace's wire time)
    part: _PartSent | None = None  # set when the part's progress is reported (see _PartSent)


_Plan = tuple[StreamKind, LocalBuffer, int, list[_Chunk]]


@dataclass(frozen=True)
class SchedulerParams:
    residual_chunk_bytes: int = 4 << 20
    residual_window: int = 2
    anchor_chunk_bytes: int = 16 << 20
    anchor_window: int = 4
    transfer_timeout_s: float = 60.0
    encode_queue_depth: int = 8
    poll_interval_s: float = 0.0002  # the sender's poll after progress (a chunk issued or done, a post) ...
    poll_max_s: float = 0.002  # ... then 1/8 of the time since, up to this, while nothing changes; a post wakes it
    abandon_hold_s: float = 60.0  # how long an abandoned write keeps its request from being quiet
    stall_timeout_s: float = 300.0  # the watchdog's bound on one request, submission (or its last part) to finished
    peer_stall_s: float = 5.0  # a peer with chunks in flight and none finished this long is stalled (rule 4)

    def __post_init__(self) -> None:
        for name in ("residual_chunk_bytes", "residual_window", "anchor_chunk_bytes", "anchor_window",
                     "encode_queue_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerParams.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.transfer_timeout_s < 1e6 or not 0 < self.poll_interval_s < 1 or not self.peer_stall_s > 0:
            raise ValueError("SchedulerParams: timeouts/intervals out of range")
        if not self.poll_interval_s <= self.poll_max_s < 1:
            raise ValueError(f"SchedulerParams: poll_max_s ({self.poll_max_s}) must be >= poll_interval_s "
                             f"({self.poll_interval_s}) and < 1 s")
        if not 0 < self.abandon_hold_s < 1e6 or not self.transfer_timeout_s <= self.stall_timeout_s < 1e6:
            raise ValueError(f"SchedulerParams: abandon_hold_s ({self.abandon_hold_s}) must be > 0 and "
                             f"stall_timeout_s ({self.stall_timeout_s}) >= transfer_timeout_s")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> SchedulerParams:
        """From a ``LynxConfig`` (residual_chunk_bytes, residual_window, transfer_timeout_s): an abandoned
        write is held as long as the receiver quarantines a failed region (``transfer_timeout_s``)."""
        timeout = config.transfer_timeout_s
        values = {"residual_chunk_bytes": config.residual_chunk_bytes, "residual_window": config.residual_window,
                  "transfer_timeout_s": timeout, "abandon_hold_s": timeout,
                  "stall_timeout_s": 3 * timeout + config.residual_timeout_s}
        return cls(**{**values, **overrides})


class SchedulerClosedError(RuntimeError):
    """submit() after close()."""


class SchedulerUnhealthyError(RuntimeError):
    """submit() while one of the scheduler's threads has stopped (the reason says which and why)."""
