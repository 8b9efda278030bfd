"""The transfer scheduler's encode side: the encode, exact and crc threads, the planning of chunks, and
the sender-thread end of their hand-over. Mixed into :class:`~sglang_lynx.transfer.scheduler.TransferScheduler`
(see ``scheduler.py`` for the lifecycle and the issue rules).

Which thread runs what:

- **lynx-encode** (``_encode_loop``): takes ``(transfer, encode)`` jobs off ``_encode_q`` in order, runs
  the codec, validates the remote target and cuts the buffers into chunks (``_plan``, ``_stream_plan``),
  then hands the chunk lists to the sender and (final part only) the checksums to the crc thread
  (``_checksum_later``) and the deferred exact encode to the exact thread.
- **lynx-exact** (``_exact_loop``, ``lynx-exact`` requests only): runs each request's deferred exact
  encode (``EncodedObject.exact``; one per part of a request streamed in parts, in order, the final one
  closing the stream) after its anchor and residual were handed to the sender, and hands its chunks over
  (the final part's checksum to the crc thread): the third stream's encode overlaps the first two's
  sending and never delays the next request's anchor encode.
- **lynx-crc** (``_crc_loop``): crc32 of each final stream buffer, anchors first across all requests
  (``_crc_q`` ranks: 0 anchor, 1 residual, 2 exact, 3 the stop ``close()`` puts), and hands the
  descriptor to the sender; a stream lands only once its bytes are done AND its descriptor is known.
- the **sender thread** runs what these threads post: ``_enqueue`` (chunks into the issue queues),
  ``_set_descriptors`` (a stream whose bytes are done lands) and ``_encode_done``.

What they may touch: these threads never touch the chunk queues, the in-flight list, stream states or
futures; every such change is a closure posted to the sender thread (``_post``), with the request it acts
on (a closure that raises fails that request). They write only a transfer's encode timestamps and, under
``_cv``, its ``encodes_running``; they put on ``_crc_q`` / ``_exact_jobs`` and report to ``self.health``.

Invariants: every job taken off ``_encode_q`` or ``_exact_jobs`` posts exactly one ``_encode_done``,
even when its thread dies inside it (``finally``), matching the ``encodes_running`` count taken when it
was queued; an exact job's count is taken before the encode that queues it gives its own back, so a
request is never quiet while any encode may still write into its send region. A part queued after its
request failed or the scheduler closed is skipped unencoded.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_lynx.transfer.progress import (
    EncodedObject,
    ExactJob,
    ExactPart,
    LocalBuffer,
    RequestTransfer,
    StreamProgress,
    TransferState,
)
from sglang_lynx.transfer.scheduler_parts import _Chunk, _PartSent, _Plan
from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind, chunk_spans, validate_target

if TYPE_CHECKING:
    from sglang_lynx.transfer.health import ComponentHealth
    from sglang_lynx.transfer.scheduler_parts import SchedulerParams
    from sglang_lynx.transfer.trace import Trace


class SchedulerEncode:
    if TYPE_CHECKING:
        params: SchedulerParams
        health: ComponentHealth
        _closing: bool
        trace: Trace
        _cv: threading.Condition
        _encode_q: queue.Queue[tuple[RequestTransfer, Callable[[], EncodedObject]] | None]
        _exact_jobs: queue.Queue[ExactJob | None]
        _crc_q: queue.PriorityQueue[tuple[Any, ...]]
        _crc_seq: itertools.count[int]
        _anchor_q: deque[_Chunk]
        _residual_q: deque[_Chunk]
        _exact_q: deque[_Chunk]

        def _post(self, fn: Callable[[], None], owner: RequestTransfer | None = None) -> None: ...

        def _land(self, stream: StreamProgress) -> None: ...

        def _fail_stream(self, transfer: RequestTransfer, stream: StreamProgress, reason: str,
                         state: TransferState = TransferState.FAILED) -> None: ...

        def _fail_request(self, transfer: RequestTransfer, reason: str,
                          state: TransferState = TransferState.FAILED) -> None: ...

        def _maybe_quiet(self, transfer: RequestTransfer) -> None: ...

        def _checksum(self, addr: int, n: int) -> int: ...

    # ----- encode thread -----
    def _encode_loop(self) -> None:
        while True:
            item = self._encode_q.get()
            if item is None:
                return
            transfer, encode = item
            try:
                self._encode_one(transfer, encode)
            finally:  # also when the thread dies in it: the encode no longer writes to the request's buffers
                self._post(lambda t=transfer: self._encode_done(t), transfer)  # type: ignore[misc]

    def _encode_one(self, transfer: RequestTransfer, encode: Callable[[], EncodedObject]) -> None:
        if self._closing:
            self._post(lambda t=transfer: self._fail_request(t, "scheduler shut down",  # type: ignore[misc]
                                                              TransferState.CANCELLED), transfer)
            return
        if transfer.anchor.state.final:  # a later part of a request that failed meanwhile: nothing to do
            return
        started = time.monotonic()
        transfer.encode_started_at = transfer.encode_started_at or started
        try:
            obj = encode()
            plan = self._plan(transfer, obj)
        except Exception as exc:  # the codec or metadata failed: the request fails, nothing sent
            reason = f"encode/validation failed: {type(exc).__name__}: {exc}"
            self._post(lambda t=transfer, r=reason: self._fail_request(t, r), transfer)  # type: ignore[misc]
            return
        transfer.encode_finished_at = time.monotonic()
        self.trace.emit("encode", rid=transfer.request_id, final=obj.final,
                        dur=round(transfer.encode_finished_at - started, 6))
        self._post(lambda t=transfer, p=plan: self._enqueue(t, p), transfer)  # type: ignore[misc]
        if obj.final:
            self._checksum_later(transfer, plan)
        if transfer.exact is not None and obj.exact is not None:  # the final part's is there (_plan checked)
            with self._cv:  # before this encode's own count is given back (finally above)
                transfer.encodes_running += 1
            self._exact_jobs.put((transfer, obj.exact, obj.final))

    def _checksum_later(self, transfer: RequestTransfer, plan: list[_Plan]) -> None:
        for kind, buf, chunk_bytes, _ in plan:  # anchors' crc first, across all requests
            rank = {StreamKind.ANCHOR: 0, StreamKind.RESIDUAL: 1}.get(kind, 2)
            self._crc_q.put((rank, next(self._crc_seq), transfer, kind, buf, chunk_bytes))

    # ----- exact thread -----
    def _exact_loop(self) -> None:
        while (item := self._exact_jobs.get()) is not None:
            transfer, encode_exact, final = item
            try:
                self._exact_one(transfer, encode_exact, final)
            finally:  # as in _encode_loop
                self._post(lambda t=transfer: self._encode_done(t), transfer)  # type: ignore[misc]

    def _exact_one(self, transfer: RequestTransfer, encode_exact: Callable[[], ExactPart], final: bool) -> None:
        """One exact encode (a part's pieces, ``final``: the last, which closes the stream): its bytes are
        queued, and with the last the stream's checksum is taken over the whole buffer."""
        stream = transfer.exact
        assert stream is not None
        if self._closing or stream.state.final:  # shut down, aborted or failed meanwhile: no encode
            self._post(lambda t=transfer, s=stream: self._fail_stream(  # type: ignore[misc]
                t, s, "scheduler shut down", TransferState.CANCELLED), transfer)
            return
        try:
            done = encode_exact()
            _check_spans(StreamKind.EXACT, done.buffer, done.spans)
            plan = [self._stream_plan(transfer, StreamKind.EXACT, done.buffer, done.spans, report=not final)]
        except Exception as exc:  # the exact stream fails (the decode recomputes); anchor and residual go on
            reason = f"exact encode failed: {type(exc).__name__}: {exc}"
            self._post(lambda t=transfer, s=stream, r=reason: self._fail_stream(t, s, r), transfer)  # type: ignore[misc]
            return
        self._post(lambda t=transfer, p=plan: self._enqueue(t, p), transfer)  # type: ignore[misc]
        if final:
            self._checksum_later(transfer, plan)

    # ----- crc thread -----
    def _crc_loop(self) -> None:
        """crc32 beside the wire (zlib drops the GIL), on its own thread so
        a large object's checksum never delays the next object's anchor; a stream is declared landed only
        once its bytes are done AND its descriptor (with crc) is known."""
        while (item := self._crc_q.get())[0] < 3:
            _, _, transfer, kind, buf, chunk_bytes = item
            try:
                descs = {kind: StreamDescriptor(transfer.request_id, kind, buf.length, chunk_bytes,
                                                self._checksum(buf.addr, buf.length))}
            except Exception as exc:  # this stream cannot be declared landed: it fails, the thread goes on
                reason = f"crc32 failed: {self.health.record('crc thread', exc)}"
                self._post(lambda t=transfer, k=kind, r=reason: self._fail_stream(  # type: ignore[misc]
                    t, t.streams[k], r), transfer)
                continue
            self.health.ok()
            self._post(lambda t=transfer, d=descs: self._set_descriptors(t, d), transfer)  # type: ignore[misc]

    # ----- planning (encode and exact threads): builds new chunks, touches no shared state -----
    def _plan(self, transfer: RequestTransfer, obj: EncodedObject) -> list[_Plan]:
        """The anchor's and residual's chunks (the exact stream, deferred, is planned on its thread; its
        region is checked here with the others, at its capacity)."""
        buffers: dict[StreamKind, LocalBuffer | None] = {StreamKind.ANCHOR: obj.anchor,
                                                         StreamKind.RESIDUAL: obj.residual}
        wanted: dict[StreamKind, LocalBuffer | None] = {k: buffers[k] for k in transfer.streams
                                                         if k is not StreamKind.EXACT}
        missing = [k.value for k, b in wanted.items() if b is None]
        if transfer.exact is not None and obj.exact is None and obj.final:
            missing.append(StreamKind.EXACT.value)
        if missing:
            raise ValueError(f"encode returned no buffer for stream(s) {missing}")
        sizes: dict[StreamKind, int] = {k: b.length for k, b in wanted.items() if b is not None}
        if transfer.exact is not None:
            region = transfer.target.regions.get(StreamKind.EXACT)
            sizes[StreamKind.EXACT] = region.capacity if region is not None else 0
        validate_target(transfer.target, sizes)
        spans = obj.spans or {}
        for kind, ranges in spans.items():
            _check_spans(kind, wanted.get(kind), ranges)
        return [self._stream_plan(transfer, kind, buf, spans.get(kind, ((0, buf.length),)), report=not obj.final)
                for kind, buf in wanted.items() if buf is not None]

    def _stream_plan(self, transfer: RequestTransfer, kind: StreamKind, buf: LocalBuffer,
                     ranges: tuple[tuple[int, int], ...] | None = None, report: bool = False) -> _Plan:
        """``buf``'s chunks (only ``ranges`` of it, each cut into chunks: a part of a streamed request);
        ``report``: a part that is not the last, of a request with an exact stream: its progress is
        reported once its chunks are done (``_PartSent``; only ``lynx-exact``'s receiver reads it)."""
        if kind is StreamKind.EXACT:
            validate_target(transfer.target, {kind: buf.length})
        chunk_bytes = (self.params.anchor_chunk_bytes if kind is StreamKind.ANCHOR
                       else self.params.residual_chunk_bytes)
        dst = transfer.target.regions[kind].addr
        ranges = ranges if ranges is not None else ((0, buf.length),)
        chunks = [_Chunk(transfer, transfer.streams[kind], transfer.target.session_id,
                         buf.addr + at + off, dst + at + off, n)
                  for at, length in ranges for off, n in chunk_spans(length, chunk_bytes)]
        if report and transfer.exact is not None and chunks:
            part = _PartSent(tuple(ranges), len(chunks))
            for chunk in chunks:
                chunk.part = part
        return kind, buf, chunk_bytes, chunks

    # ----- sender thread: what the encode side hands over (posted by the threads above) -----
    def _encode_done(self, transfer: RequestTransfer) -> None:
        """Sender thread: an encode of ``transfer`` (queued or running) is over; it may now be quiet."""
        with self._cv:
            transfer.encodes_running -= 1
        self._maybe_quiet(transfer)

    def _enqueue(self, transfer: RequestTransfer, plan: list[_Plan]) -> None:
        now = time.monotonic()
        for kind, _, _, chunks in plan:
            stream = transfer.streams[kind]
            if stream.state.final:  # aborted or failed while encoding
                continue
            stream.chunks_total += len(chunks)  # a streamed request's parts add up
            if stream.state is TransferState.WAITING_ENCODE:
                stream.queued_at, stream.state = now, TransferState.QUEUED
            {StreamKind.ANCHOR: self._anchor_q, StreamKind.RESIDUAL: self._residual_q,
             StreamKind.EXACT: self._exact_q}[kind].extend(chunks)

    def _set_descriptors(self, transfer: RequestTransfer, descs: dict[StreamKind, StreamDescriptor]) -> None:
        for kind, desc in descs.items():
            stream = transfer.streams[kind]
            stream.descriptor = desc
            if stream.chunks_done == stream.chunks_total and not stream.state.final:
                self._land(stream)
        self._maybe_quiet(transfer)


def _check_spans(kind: StreamKind, buf: LocalBuffer | None, ranges: tuple[tuple[int, int], ...]) -> None:
    """A part's ``(offset, length)`` ranges of ``kind`` lie inside its buffer (and there is one)."""
    if buf is None or any(at < 0 or n < 1 or at + n > buf.length for at, n in ranges):
        raise ValueError(f"part spans of stream {kind.value} fall outside its buffer")
