"""What the transfer scheduler does with work it will not finish (see ``scheduler.py``, "Guarded
threads" and "Watchdog"): fail what the sender owns after an error that left its state unknown, the work
of a thread that stopped, a request stuck past ``stall_timeout_s`` (the watchdog) and, at shutdown, the
chunks not yet on the wire. Mixed into :class:`~sglang_lynx.transfer.scheduler.TransferScheduler`; every
method runs on the thread named in its docstring.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang_lynx.transfer.progress import ExactJob, RequestTransfer, StreamProgress, TransferState

if TYPE_CHECKING:
    from sglang_lynx.transfer.abandoned import AbandonedWrites
    from sglang_lynx.transfer.health import ComponentHealth
    from sglang_lynx.transfer.progress import EncodedObject
    from sglang_lynx.transfer.scheduler_parts import EngineLike, SchedulerParams, _Chunk

log = logging.getLogger("sglang_lynx.transfer.scheduler")  # the scheduler's records keep their logger


class SchedulerRecovery:
    if TYPE_CHECKING:
        engine: EngineLike
        params: SchedulerParams
        health: ComponentHealth
        abandoned: AbandonedWrites
        _cv: threading.Condition
        _inbox: deque[tuple[Callable[[], None], RequestTransfer | None]]
        _encode_q: queue.Queue[tuple[RequestTransfer, Callable[[], EncodedObject]] | None]
        _in_flight: list[_Chunk]
        _anchor_q: deque[_Chunk]
        _residual_q: deque[_Chunk]
        _exact_q: deque[_Chunk]
        _exact_jobs: queue.Queue[ExactJob | None]
        _peer_progress: dict[str, float]
        _live: dict[int, RequestTransfer]
        _next_watchdog: float

        def _post(self, fn: Callable[[], None], owner: RequestTransfer | None = None) -> None: ...

        def _fail_stream(self, transfer: RequestTransfer, stream: StreamProgress, reason: str,
                         state: TransferState = TransferState.FAILED) -> None: ...

        def _fail_request(self, transfer: RequestTransfer, reason: str,
                          state: TransferState = TransferState.FAILED) -> None: ...

        def _maybe_quiet(self, transfer: RequestTransfer) -> None: ...

        def _encode_done(self, transfer: RequestTransfer) -> None: ...

    def _settled(self, handle: Any) -> bool:
        try:
            return bool(self.engine.settled(handle))
        except Exception as exc:  # unknown: held until abandon_hold_s passes
            self.health.record("engine settled", exc)
            return False

    def _fail_owned(self, reason: str) -> None:
        """Fail every transfer the sender owns (after an error that left its state unknown). In-flight
        writes are held as abandoned: their bytes may still land, so their requests are not quiet."""
        now = time.monotonic()
        owners = {id(c.transfer): c.transfer for c in (*self._in_flight, *self._anchor_q, *self._residual_q,
                                                           *self._exact_q)}
        for chunk in self._in_flight:
            chunk.transfer.in_flight_chunks -= 1
            self.abandoned.add(chunk.transfer, chunk.handle, now)
        self._in_flight = []
        self._peer_progress.clear()
        self._anchor_q.clear()
        self._residual_q.clear()
        self._exact_q.clear()
        with self._cv:
            owners.update(self._live)
        for transfer in owners.values():
            self._fail_request(transfer, reason)

    def _on_sender_death(self, reason: str) -> None:
        with self._cv:
            inbox = list(self._inbox)
            self._inbox.clear()
        self._fail_owned(reason)
        for _, owner in inbox:
            if owner is not None:
                self._fail_request(owner, reason)

    def _on_crc_death(self, reason: str) -> None:
        """No descriptor will come: every stream still waiting for one fails."""
        def fail_waiting() -> None:
            with self._cv:
                live = list(self._live.values())
            for transfer in live:
                for stream in transfer.streams.values():
                    if stream.descriptor is None:
                        self._fail_stream(transfer, stream, reason)
                self._maybe_quiet(transfer)
        self._post(fail_waiting)

    def _fail_queued_and_live(self, jobs: queue.Queue[Any], fail: Callable[[RequestTransfer], None],
                              live_too: Callable[[RequestTransfer], bool]) -> None:
        """On the sender thread: ``fail`` each request still queued in ``jobs`` (drained here: its encode
        will not run) and each live request for which ``live_too`` holds."""
        def fail_unencoded(transfer: RequestTransfer) -> None:
            fail(transfer)
            self._encode_done(transfer)

        while True:
            try:
                item = jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._post(lambda t=item[0]: fail_unencoded(t), item[0])  # type: ignore[misc]
        with self._cv:
            live = list(self._live.values())
        for transfer in live:
            if live_too(transfer):
                self._post(lambda t=transfer: fail(t), transfer)  # type: ignore[misc]

    def _on_encoder_death(self, reason: str) -> None:
        self._fail_queued_and_live(self._encode_q, lambda t: self._fail_request(t, reason),
                                   lambda t: t.encode_finished_at == 0.0)

    def _on_exact_death(self, reason: str) -> None:
        """No exact stream will be encoded: every request waiting for one loses it (the decode recomputes)."""
        def fail_exact(transfer: RequestTransfer) -> None:
            # not closed yet (its last part's encode will not run; earlier parts may be queued)
            if transfer.exact is not None and transfer.exact.descriptor is None:
                self._fail_stream(transfer, transfer.exact, reason)
            self._maybe_quiet(transfer)

        self._fail_queued_and_live(self._exact_jobs, fail_exact, lambda t: True)

    def _watchdog(self, now: float) -> None:
        """Sender thread: fail any request not finished ``stall_timeout_s`` after its submission or its last
        part's (``RequestTransfer.active_since``; checked once a second)."""
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + 1.0
        with self._cv:
            stalled = [t for t in self._live.values()
                       if not t.finished and now - t.active_since > self.params.stall_timeout_s]
        for transfer in stalled:
            log.error("lynx: request %s made no progress for %.0f s: %s", transfer.request_id,
                      now - transfer.active_since, transfer.summary())
            self._fail_request(transfer, f"watchdog: not finished {self.params.stall_timeout_s:.0f} s after "
                                         "its submission or last part")

    def _cancel_queued(self) -> None:
        """Sender thread (at shutdown): cancel every chunk not yet on the wire."""
        for q in (self._anchor_q, self._residual_q, self._exact_q):
            while q:
                c = q.popleft()
                self._fail_stream(c.transfer, c.stream, "scheduler shut down", TransferState.CANCELLED)
                self._maybe_quiet(c.transfer)
