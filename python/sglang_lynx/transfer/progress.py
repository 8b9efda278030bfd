"""Per-request, per-stream transfer progress on the sending side: states, futures, events.

A :class:`RequestTransfer` is what :meth:`TransferScheduler.submit` returns. It holds one
:class:`StreamProgress` per stream (``ANCHOR`` always, ``RESIDUAL`` in progressive mode, ``EXACT``
in ``lynx-exact``) and a ``quiet`` future. State machine of a stream (:class:`TransferState`)::

    WAITING_ENCODE -> QUEUED -> IN_FLIGHT -> LANDED
          \\             \\          \\------> FAILED     (engine code, deadline, sibling failure)
           \\-------------\\-----------------> FAILED / CANCELLED (encode error, bad metadata, abort,
                                                                    shutdown)

- ``StreamProgress.future`` resolves to the stream's :class:`StreamDescriptor` when every chunk has
  landed, or raises :class:`StreamFailure` naming the request, the stream and the reason.
- ``RequestTransfer.quiet`` resolves once no write of the request can still land in the peer's memory
  (every issued chunk finished, none abandoned after a deadline). The receiver may then reuse the
  staging region at once (``StagingAllocator.sender_quiet``); otherwise it waits out its quarantine.

Mutations happen only on the scheduler's sender thread (futures are thread-safe for readers).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from sglang_lynx.transfer.streams import RemoteTarget, StreamDescriptor, StreamKind


class TransferState(enum.Enum):
    WAITING_ENCODE = "waiting_encode"
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    LANDED = "landed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (TransferState.LANDED, TransferState.FAILED, TransferState.CANCELLED)


class StreamFailure(RuntimeError):
    """A stream did not land: which request, which stream, why."""

    def __init__(self, request_id: str, kind: StreamKind, reason: str) -> None:
        self.request_id, self.kind, self.reason = request_id, kind, reason
        super().__init__(f"request {request_id}: {kind.value} stream failed: {reason}")


@dataclass(frozen=True)
class LocalBuffer:
    """A contiguous byte buffer in this process's registered memory."""

    addr: int
    length: int


@dataclass(frozen=True)
class ExactPart:
    """What an exact encode returns: the exact stream so far (from its region's start) and the
    ``(offset, length)`` ranges of it this encode wrote (only those are sent)."""

    buffer: LocalBuffer
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, buffer: LocalBuffer) -> ExactPart:
        """A stream encoded in one go: all of ``buffer`` is new."""
        return cls(buffer, ((0, buffer.length),) if buffer.length else ())


@dataclass(frozen=True)
class EncodedObject:
    """What an encode function returns: the anchor buffer and, in progressive mode, the residual.

    ``exact`` (``lynx-exact``): the deferred third stream, a callable the scheduler runs on its exact
    thread once this object's anchor and residual are queued (its encode overlaps their sending); it
    returns an :class:`ExactPart` (the buffer must fit the stream's remote region). Parts of one request
    run in order; any part may have one, the final part must (it closes the stream: its checksum is
    taken then).

    Parts (a request streamed while its prefill runs, ``TransferScheduler.extend``): ``spans`` names,
    per stream, the ``(offset, length)`` ranges of the whole-stream buffer this part wrote (only those
    are sent; None: the whole buffer); ``final`` says the buffers are now complete, so the streams'
    checksums are taken and the exact stream closed. The buffers are the whole streams every time."""

    anchor: LocalBuffer
    residual: LocalBuffer | None = None
    exact: Callable[[], ExactPart] | None = None
    spans: dict[StreamKind, tuple[tuple[int, int], ...]] | None = None
    final: bool = True


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    kind: StreamKind
    state: TransferState
    descriptor: StreamDescriptor | None = None
    error: StreamFailure | None = None
    # a progress event (the stream not final yet): these bytes of it, (offset, length), are in place
    spans: tuple[tuple[int, int], ...] | None = None


@dataclass
class StreamProgress:
    request_id: str
    kind: StreamKind
    state: TransferState = TransferState.WAITING_ENCODE
    descriptor: StreamDescriptor | None = None
    future: Future[StreamDescriptor] = field(default_factory=Future)
    chunks_total: int = 0
    chunks_done: int = 0
    queued_at: float = 0.0
    first_issue_at: float = 0.0
    landed_at: float = 0.0


@dataclass
class RequestTransfer:
    request_id: str
    target: RemoteTarget
    streams: dict[StreamKind, StreamProgress]
    submitted_at: float
    last_part_at: float = 0.0  # when its last part was queued (``extend``; 0: its only one, at submission)
    encode_started_at: float = 0.0
    encode_finished_at: float = 0.0
    in_flight_chunks: int = 0
    abandoned_chunks: int = 0  # issued, then given up on at a deadline: may still land remotely
    encodes_running: int = 0  # encodes (queued or running) that write into its send buffers: not quiet before
    quiet: Future[None] = field(default_factory=Future)
    quiet_decided: bool = False  # set (under the scheduler's lock) just before ``quiet`` resolves

    @property
    def anchor(self) -> StreamProgress:
        return self.streams[StreamKind.ANCHOR]

    @property
    def residual(self) -> StreamProgress | None:
        return self.streams.get(StreamKind.RESIDUAL)

    @property
    def exact(self) -> StreamProgress | None:
        return self.streams.get(StreamKind.EXACT)

    @property
    def finished(self) -> bool:
        return all(s.state.final for s in self.streams.values())

    @property
    def active_since(self) -> float:
        """The watchdog's clock: its submission, or its last part's (a prefill that streams its parts for
        longer than ``stall_timeout_s`` in all is not stuck)."""
        return max(self.submitted_at, self.last_part_at)

    def summary(self) -> dict[str, object]:
        """Where the request stands (for ``/get_server_info``): per stream state and chunks done."""
        streams = {k.value: f"{s.state.value} {s.chunks_done}/{s.chunks_total}" for k, s in self.streams.items()}
        return {"request_id": self.request_id, "age_s": round(time.monotonic() - self.submitted_at, 1),
                "streams": streams, "in_flight_chunks": self.in_flight_chunks,
                "abandoned_chunks": self.abandoned_chunks}


#: A queued exact encode: (request, the part's exact callable, final).
ExactJob = tuple[RequestTransfer, Callable[[], ExactPart], bool]
