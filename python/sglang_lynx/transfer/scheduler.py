"""Priority transfer scheduler: anchors first across all requests, residuals chunked and windowed, the
``lynx-exact`` stream last.

Mooncake has no priority (per-peer lanes are FIFO), so the order is made here. Rules, across every
request on one sender:

1. Anchor chunks are issued in submission order, at most ``anchor_window`` in flight.
2. A residual chunk (``residual_chunk_bytes``) is issued only while NO anchor chunk is queued or in
   flight, and at most ``residual_window`` residual chunks are in flight. An anchor therefore waits at
   most for the residual window that was already on the wire when it arrived.
3. One-stream modes submit only an anchor-class stream through the same path.
3b. An exact chunk (``lynx-exact``'s third stream, ``residual_chunk_bytes`` each) is issued only while
   no anchor and no residual chunk of a peer that is not stalled is queued, within the residual window
   (exact and residual chunks in flight count together).
4. A **stalled** peer (chunks in flight, none finished for ``peer_stall_s``: a hung or dead decode
   server whose writes will only end at their deadline) does not hold the others back: its chunks stop
   counting in the windows and in rule 2, and its queued chunks wait (in order) while the other
   peers' chunks are issued. Without this, one hung peer's anchor chunk held every residual to every
   peer for ``transfer_timeout_s``.

Thread model (one scheduler per sender / KV manager):

- ``submit()`` (any thread) puts a job on a bounded encode queue (blocks when full, up to a timeout).
  A request streamed while its prefill runs is submitted with its first part (``EncodedObject.final``
  False: only the part's ``spans`` are sent) and ``extend()`` queues each later part on the same queue,
  in order; its streams land only after the final part (whose encode completes the buffers and takes
  the checksums). Parts obey the rules above as any chunk does: a later part's anchor goes before an
  earlier part's queued residual. ``extend`` refuses (False) once the request is over, and a part
  queued before a failure is skipped unencoded, so nothing writes into a send region that is quiet.
- The **encode thread** runs the job's ``encode()`` (the codec) and hands the chunks to the sender; the
  **crc thread** takes each stream's crc32 while its chunks are on the wire (a stream is LANDED only when
  its bytes are done and its descriptor is known); the **exact thread** (``lynx-exact`` only) runs each
  request's deferred exact encode after its anchor and residual were handed over. Object i+1 is encoded
  while object i is on the wire: that is the encode/transfer overlap. All three are in
  ``transfer/scheduler_encode.py`` (what each may touch, and the ``encodes_running`` count).
- The **sender thread** owns all mutable transfer state: it issues chunks through the engine, polls
  them (sleep-poll, no busy spin: ``poll_interval_s`` after any progress, then an eighth of the time since
  it, up to ``poll_max_s``, and any post wakes it at once), applies the optional link pacer, resolves futures
  and emits events.
- ``close(timeout_s)`` stops intake, cancels what is not yet on the wire, waits (bounded) for in-flight
  chunks, fails the rest, and joins every thread with the same bound.

Guarded threads (``self.health``, ``transfer/health.py``): an exception while handling one request (its
closure on the sender thread, its engine poll, its checksum) fails THAT request with the reason and
the thread goes on; an exception anywhere else in the sender loop fails every transfer the sender
owns (their state is unknown; in-flight writes are held as abandoned so nothing reuses their bytes)
and the loop goes on; a thread that ends unexpectedly fails what it owned, marks the scheduler
unhealthy (``unhealthy_reason()``) and ``submit`` then refuses with that reason instead of queueing
into a dead thread. ``issue_log`` keeps the last ``ISSUE_LOG_ENTRIES`` issues only (a ring).

Engine contract (:class:`EngineLike`): ``submit_write(peer, src, dst, n, deadline_s) -> handle`` raises
on refusal; ``poll(handle) -> WriteStatus`` where DONE / FAILED / TIMED_OUT are final;
``settled(handle)`` says whether a TIMED_OUT write has finished in the engine since
(``transfer/abandoned.py`` holds those until it has, or ``abandon_hold_s`` passed).

Watchdog (``scheduler_recovery.py``): a request that is still not finished ``stall_timeout_s`` after
its submission or its last part's (every write has its own deadline, so this catches only a stream stuck
outside the wire: never encoded, never checksummed, queued forever; a prefill streaming its parts for
longer than that in all is not stuck) is failed with the reason. Quiet (the send region may
be reused) waits for every encode of the request, queued or running, to be over
(``RequestTransfer.encodes_running``): a request failed while its codec still writes into its region
must not hand that region to the next request; an encode that never returns holds its region (and its
thread) for good.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sglang_lynx.transfer.abandoned import AbandonedWrites
from sglang_lynx.transfer.health import ComponentHealth
from sglang_lynx.transfer.mooncake_engine import WriteStatus
from sglang_lynx.transfer.progress import (
    EncodedObject,
    ExactJob,
    RequestTransfer,
    StreamEvent,
    StreamFailure,
    StreamProgress,
    TransferState,
)
from sglang_lynx.transfer.scheduler_encode import SchedulerEncode
from sglang_lynx.transfer.scheduler_parts import EngineLike as EngineLike
from sglang_lynx.transfer.scheduler_parts import PacerLike as PacerLike
from sglang_lynx.transfer.scheduler_parts import SchedulerClosedError as SchedulerClosedError
from sglang_lynx.transfer.scheduler_parts import SchedulerParams as SchedulerParams
from sglang_lynx.transfer.scheduler_parts import SchedulerUnhealthyError as SchedulerUnhealthyError
from sglang_lynx.transfer.scheduler_parts import _Chunk
from sglang_lynx.transfer.scheduler_recovery import SchedulerRecovery
from sglang_lynx.transfer.streams import RemoteTarget as RemoteTarget
from sglang_lynx.transfer.streams import StreamKind, checksum_at
from sglang_lynx.transfer.trace import trace

log = logging.getLogger(__name__)

ISSUE_LOG_ENTRIES = 4096  # issue_log is a ring of this many (request, stream, offset) entries


class TransferScheduler(SchedulerEncode, SchedulerRecovery):
    def __init__(self, engine: EngineLike, params: SchedulerParams | None = None,
                 pacer: PacerLike | None = None,
                 on_event: Callable[[StreamEvent], None] | None = None) -> None:
        self.engine, self.pacer, self.on_event = engine, pacer, on_event
        self.params = params or SchedulerParams()
        self._encode_q: queue.Queue[tuple[RequestTransfer, Callable[[], EncodedObject]] | None] = (
            queue.Queue(self.params.encode_queue_depth))
        self._cv = threading.Condition()
        # closures run on the sender thread, each with the transfer it acts on (failed if it raises)
        self._inbox: deque[tuple[Callable[[], None], RequestTransfer | None]] = deque()
        self._anchor_q: deque[_Chunk] = deque()
        self._residual_q: deque[_Chunk] = deque()
        self._exact_q: deque[_Chunk] = deque()
        self._exact_jobs: queue.Queue[ExactJob | None] = queue.Queue()
        self._in_flight: list[_Chunk] = []
        self._peer_progress: dict[str, float] = {}  # peer with chunks in flight -> last chunk finished
        self.health = ComponentHealth("transfer scheduler")
        self.trace = trace()  # off unless SGLANG_LYNX_TRACE_DIR is set (transfer/trace.py)
        self.abandoned = AbandonedWrites(self._settled, self.params.abandon_hold_s,
                                         forget=getattr(engine, "forget", None))
        self._live: dict[int, RequestTransfer] = {}  # submitted, not yet quiet (sender thread)
        self._next_watchdog = 0.0
        self._closing = False
        self._stop = threading.Event()
        self._progress = 0  # chunks issued or finished and closures run (sender thread): resets the poll backoff
        self._poll_s = self.params.poll_interval_s
        self._progress_at = 0.0  # monotonic time of the last progress
        # (request, stream, offset) in issue order, the last ISSUE_LOG_ENTRIES only
        self.issue_log: deque[tuple[str, StreamKind, int]] = deque(maxlen=ISSUE_LOG_ENTRIES)
        # (rank, seq, transfer, kind, buffer, chunk_bytes); rank 0 anchor, 1 residual, 2 exact, 3 stop
        self._crc_q: queue.PriorityQueue[tuple[Any, ...]] = queue.PriorityQueue()
        self._crc_seq = itertools.count()
        closing = lambda: self._closing  # noqa: E731
        self._crc = threading.Thread(target=self.health.thread("lynx-crc", self._crc_loop, closing,
                                                               self._on_crc_death), name="lynx-crc", daemon=True)
        self._crc.start()
        self._encoder = threading.Thread(target=self.health.thread("lynx-encode", self._encode_loop, closing,
                                                                   self._on_encoder_death),
                                         name="lynx-encode", daemon=True)
        self._sender = threading.Thread(target=self.health.thread("lynx-send", self._send_loop, closing,
                                                                  self._on_sender_death),
                                        name="lynx-send", daemon=True)
        self._exact = threading.Thread(target=self.health.thread("lynx-exact", self._exact_loop, closing,
                                                                 self._on_exact_death), name="lynx-exact", daemon=True)
        self._encoder.start()
        self._exact.start()
        self._sender.start()

    # ----- public API -----
    def submit(self, request_id: str, target: RemoteTarget, encode: Callable[[], EncodedObject],
               progressive: bool = True, timeout_s: float = 30.0, exact: bool = False) -> RequestTransfer:
        """Queue one request; ``encode`` runs on the encode thread and returns the buffers to send
        (``exact``: a third stream too, ``EncodedObject.exact``; progressive requests only)."""
        if self._closing:
            raise SchedulerClosedError(f"submit({request_id!r}) after close()")
        if exact and not progressive:
            raise ValueError(f"submit({request_id!r}): an exact stream needs the residual (progressive=True)")
        threads = (self._sender, self._encoder, self._crc, self._exact)
        # a thread that died is recorded before its work is failed (and before it has quite ended): either sign
        if self.health.dead_reason() is not None or not all(t.is_alive() for t in threads):
            raise SchedulerUnhealthyError(f"submit({request_id!r}): {self.unhealthy_reason()}")
        kinds = ([StreamKind.ANCHOR] + ([StreamKind.RESIDUAL] if progressive else [])
                 + ([StreamKind.EXACT] if exact else []))
        now = time.monotonic()
        transfer = RequestTransfer(request_id, target, {k: StreamProgress(request_id, k) for k in kinds}, now)
        transfer.encodes_running = 1  # its encode job, queued below
        try:
            self._encode_q.put((transfer, encode), timeout=timeout_s)
        except queue.Full:
            raise TimeoutError(f"submit({request_id!r}): encode queue full for {timeout_s} s") from None
        self._post(lambda: self._track(transfer), transfer)
        return transfer

    def extend(self, transfer: RequestTransfer, encode: Callable[[], EncodedObject], timeout_s: float = 30.0) -> bool:
        """Queue the next part of a request submitted with a non-final part (see the module docstring).
        False, with nothing queued, when the request is already over (failed, cancelled, quiet): the
        caller must then not write into its send buffers."""
        with self._cv:
            if transfer.quiet_decided or transfer.anchor.state.final:
                return False
            transfer.encodes_running += 1  # under the lock: quiet cannot be decided past this encode
            transfer.last_part_at = time.monotonic()
        try:
            self._encode_q.put((transfer, encode), timeout=timeout_s)
        except queue.Full:
            self._post(lambda: self._encode_done(transfer), transfer)
            self._post(lambda: self._fail_request(transfer, f"encode queue full for {timeout_s} s"), transfer)
            return False
        return True

    def unhealthy_reason(self) -> str | None:
        """Why the scheduler is unhealthy (a thread stopped, errors in a row), None while healthy."""
        return self.health.unhealthy_reason()

    def live(self) -> list[dict[str, Any]]:
        """Requests submitted and not yet quiet, oldest first (observability; any thread)."""
        with self._cv:
            transfers = list(self._live.values())
        return [t.summary() for t in transfers]

    def abort(self, transfer: RequestTransfer, reason: str = "aborted") -> None:
        """Cancel what is not yet on the wire; in-flight chunks finish (then ``quiet`` resolves)."""
        self._post(lambda: self._fail_request(transfer, reason, TransferState.CANCELLED), transfer)

    def close(self, timeout_s: float = 10.0) -> None:
        """Bounded shutdown: cancel queued work, wait for in-flight chunks, join threads."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            self._encode_q.put(None, timeout=max(0.0, deadline - time.monotonic()))
        self._encoder.join(max(0.0, deadline - time.monotonic()))
        self._exact_jobs.put(None)
        self._exact.join(max(0.0, deadline - time.monotonic()))
        self._crc_q.put((3, next(self._crc_seq)))
        self._crc.join(max(0.0, deadline - time.monotonic()))
        self._post(self._cancel_queued)
        while time.monotonic() < deadline and self._sender.is_alive():
            with self._cv:
                if not self._in_flight and not self._inbox:
                    break
            time.sleep(0.001)
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self._sender.join(max(0.0, deadline - time.monotonic()) + 0.1)

    def _checksum(self, addr: int, n: int) -> int:
        """crc thread: ``checksum_at`` of this module, looked up at each call (tests replace it here)."""
        return checksum_at(addr, n)

    # ----- sender thread -----
    def _post(self, fn: Callable[[], None], owner: RequestTransfer | None = None) -> None:
        with self._cv:
            self._inbox.append((fn, owner))
            self._cv.notify_all()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._send_step()
                self.health.ok()
            except Exception as exc:  # state of the sender unknown: fail what it owns, keep serving
                self._fail_owned(self.health.record("sender thread", exc))
                time.sleep(0.01)  # an error that repeats at once must not spin
        for chunk in list(self._in_flight):  # close() timed out with chunks still on the wire
            chunk.transfer.abandoned_chunks += 1
            self._fail_stream(chunk.transfer, chunk.stream, "scheduler shut down with a chunk in flight")
        self._in_flight.clear()
        self._cancel_queued()

    def _run_inbox(self) -> None:
        with self._cv:
            inbox = list(self._inbox)
            self._inbox.clear()
        self._progress += len(inbox)
        for fn, owner in inbox:
            try:
                fn()
            except Exception as exc:  # one request's closure failed: that request fails
                reason = self.health.record("sender thread", exc)
                if owner is None:
                    self._fail_owned(reason)
                else:
                    self._fail_request(owner, reason)

    def _send_step(self) -> None:
        progress = self._progress
        self._run_inbox()
        self._reap()
        now = time.monotonic()
        for transfer in self.abandoned.check(now):
            self._maybe_quiet(transfer)
        self._watchdog(now)
        self._issue()
        p, now = self.params, time.monotonic()
        # the poll backs off while chunks are on the wire and nothing changes (a slow link: each chunk takes
        # tens of ms, and 5,000 polls a second cost the prefill's forward a sixth of a core): the wait is an
        # eighth of the time since the last progress, so a finish is seen at most ~12% late (a fast link's
        # chunks, done within a millisecond or two, keep it at poll_interval_s and the wire busy), and at most
        # poll_max_s; any post (a new part, a descriptor, an abort) notifies the condition: it wakes at once
        if self._progress != progress:
            self._progress_at = now
        self._poll_s = min(p.poll_max_s, max(p.poll_interval_s, (now - self._progress_at) / 8))
        with self._cv:
            # abandoned writes do not make the loop busy: the idle wait (50 ms) is shorter than
            # their check interval (AbandonedWrites.check_interval_s)
            idle = not (self._in_flight or self._anchor_q or self._residual_q or self._exact_q or self._inbox)
            if not self._inbox:
                self._cv.wait(0.05 if idle else self._poll_s)

    def _issue(self) -> None:
        p, now = self.params, time.monotonic()
        stalled = {peer for peer, last in self._peer_progress.items() if now - last > p.peer_stall_s}
        counting = [c for c in self._in_flight if c.peer not in stalled]
        n_anchor = sum(1 for c in counting if c.stream.kind is StreamKind.ANCHOR)
        n_anchor += self._take(self._anchor_q, p.anchor_window - n_anchor, stalled)
        if n_anchor or any(c.peer not in stalled for c in self._anchor_q):
            return  # strict priority: no residual byte while an anchor is waiting or on the wire
        n_lower = len(counting) + self._take(self._residual_q, p.residual_window - len(counting), stalled)
        if any(c.peer not in stalled for c in self._residual_q):
            return  # the exact stream goes after every residual byte
        self._take(self._exact_q, p.residual_window - n_lower, stalled)

    def _take(self, q: deque[_Chunk], budget: int, stalled: set[str]) -> int:
        """Issue up to ``budget`` chunks of ``q`` in order; those of stalled peers stay queued, in order."""
        issued, kept = 0, []
        while q and issued < budget:
            chunk = q.popleft()
            if chunk.peer in stalled and not chunk.stream.state.final:
                kept.append(chunk)
                continue
            issued += self._issue_one(chunk)
        q.extendleft(reversed(kept))
        return issued

    def _issue_one(self, chunk: _Chunk) -> int:
        if chunk.stream.state.final:
            return 0
        now = time.monotonic()
        try:
            chunk.handle = self.engine.submit_write(chunk.peer, chunk.src, chunk.dst, chunk.length,
                                                    self.params.transfer_timeout_s)
        except Exception as exc:
            self._fail_stream(chunk.transfer, chunk.stream, f"submit refused: {type(exc).__name__}: {exc}")
            return 0
        if self.pacer is not None:
            try:
                chunk.emulated_finish = self.pacer.reserve(chunk.length, now)
            except Exception as exc:  # the chunk is on the wire: track it, unpaced
                self.health.record("link pacer", exc)
        if chunk.stream.state is TransferState.QUEUED:
            chunk.stream.state, chunk.stream.first_issue_at = TransferState.IN_FLIGHT, now
        chunk.transfer.in_flight_chunks += 1
        chunk.issued_at = now
        self._progress += 1
        if self.trace.enabled:
            self.trace.emit("issue", rid=chunk.transfer.request_id, kind=chunk.stream.kind.value, bytes=chunk.length)
        self._peer_progress.setdefault(chunk.peer, now)
        self._in_flight.append(chunk)
        self.issue_log.append((chunk.transfer.request_id, chunk.stream.kind, chunk.dst))
        return 1

    def _reap(self) -> None:
        now = time.monotonic()
        still: list[_Chunk] = []
        before = len(self._in_flight)
        for chunk in self._in_flight:
            if not chunk.engine_done:
                try:
                    status = self.engine.poll(chunk.handle)
                except Exception as exc:  # this write's fate is unknown: its stream fails, its bytes are held
                    chunk.transfer.in_flight_chunks -= 1
                    self.abandoned.add(chunk.transfer, chunk.handle, now)
                    reason = f"write to {chunk.peer}: {self.health.record('engine poll', exc)}"
                    self._fail_stream(chunk.transfer, chunk.stream, reason)
                    continue
                if status is WriteStatus.PENDING:
                    still.append(chunk)
                    continue
                if status is not WriteStatus.DONE:
                    chunk.transfer.in_flight_chunks -= 1
                    if status is WriteStatus.TIMED_OUT:
                        self.abandoned.add(chunk.transfer, chunk.handle, now)
                    else:  # the peer answered: not stalled
                        self._peer_progress[chunk.peer] = now
                    code = getattr(chunk.handle, "code", "?")
                    reason = f"write to {chunk.peer} {status.value} (code {code})"
                    self._fail_stream(chunk.transfer, chunk.stream, reason)
                    self._maybe_quiet(chunk.transfer)
                    continue
                chunk.engine_done = True
            if now < chunk.emulated_finish:
                still.append(chunk)
                continue
            chunk.transfer.in_flight_chunks -= 1
            chunk.stream.chunks_done += 1
            if self.trace.enabled:
                self.trace.emit("done", rid=chunk.transfer.request_id, kind=chunk.stream.kind.value,
                                bytes=chunk.length, wire_s=round(now - chunk.issued_at, 6))
            self._peer_progress[chunk.peer] = now
            self._report_part(chunk)
            if (chunk.stream.chunks_done == chunk.stream.chunks_total and not chunk.stream.state.final
                    and chunk.stream.descriptor is not None):
                self._land(chunk.stream)
            self._maybe_quiet(chunk.transfer)
        self._in_flight = still
        self._progress += before - len(still)
        peers = {c.peer for c in still}
        for peer in [p for p in self._peer_progress if p not in peers]:
            del self._peer_progress[peer]

    def _report_part(self, chunk: _Chunk) -> None:
        """The chunk was the last of its part (``_PartSent``) to be done: tell the listener those bytes are in
        place (not once the stream landed or failed: its own event says more)."""
        part = chunk.part
        if part is None:
            return
        part.remaining -= 1
        if part.remaining == 0 and not chunk.stream.state.final:
            self._emit(StreamEvent(chunk.stream.request_id, chunk.stream.kind, chunk.stream.state, spans=part.spans))

    # ----- state transitions (sender thread) -----
    def _land(self, stream: StreamProgress) -> None:
        stream.state, stream.landed_at = TransferState.LANDED, time.monotonic()
        self.trace.emit("land", rid=stream.request_id, kind=stream.kind.value)
        assert stream.descriptor is not None
        stream.future.set_result(stream.descriptor)
        self._emit(StreamEvent(stream.request_id, stream.kind, stream.state, stream.descriptor))

    def _fail_stream(self, transfer: RequestTransfer, stream: StreamProgress, reason: str,
                     state: TransferState = TransferState.FAILED) -> None:
        if stream.state.final:
            return
        err = StreamFailure(stream.request_id, stream.kind, reason)
        stream.state = state
        stream.future.set_exception(err)
        self._emit(StreamEvent(stream.request_id, stream.kind, state, stream.descriptor, err))
        later = {StreamKind.ANCHOR: transfer.residual, StreamKind.RESIDUAL: transfer.exact}.get(stream.kind)
        if later is not None:
            # the request cannot be decoded without its anchor: its residual goes too (and without its
            # residual, its exact stream)
            self._fail_stream(transfer, later, f"{stream.kind.value} stream failed: {reason}", state)

    def _fail_request(self, transfer: RequestTransfer, reason: str,
                      state: TransferState = TransferState.FAILED) -> None:
        for stream in transfer.streams.values():
            self._fail_stream(transfer, stream, reason, state)
        self._maybe_quiet(transfer)

    def _maybe_quiet(self, transfer: RequestTransfer) -> None:
        with self._cv:  # encodes_running is counted up by extend() on other threads, under this lock
            if not (transfer.finished and transfer.in_flight_chunks == 0 and transfer.abandoned_chunks == 0
                    and transfer.encodes_running == 0 and not transfer.quiet_decided):
                return
            transfer.quiet_decided = True  # extend() refuses from here on
            self._live.pop(id(transfer), None)
        transfer.quiet.set_result(None)  # its callbacks run outside the lock

    def _track(self, transfer: RequestTransfer) -> None:
        if not transfer.quiet.done():
            with self._cv:
                self._live[id(transfer)] = transfer

    def _emit(self, event: StreamEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a listener must not kill the sender thread
                log.exception("lynx transfer event listener raised on %s", event)

