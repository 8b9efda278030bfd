"""Health of a transport component's threads: errors counted and logged, a dead thread reported.

Every thread the transport starts (the scheduler's encode / crc / send threads, the control server's
receive thread) runs its work under one :class:`ComponentHealth`:

- an exception while handling one item (a request's closure, a checksum, a message) is caught,
  logged with its traceback and counted (:meth:`ComponentHealth.record` returns the reason text the
  caller puts in the failure of what that item owned); the thread goes on with the next item;
- ``CONSECUTIVE_LIMIT`` errors in a row with no success between them mark the component unhealthy
  (``unhealthy_reason``) until the next success: it still serves, but the server reports it;
- a thread that ends while the component is not closing (anything that escaped, even a
  ``BaseException``) marks it unhealthy for good: :meth:`ComponentHealth.thread` wraps the thread's
  body, runs ``on_death(reason)`` (fail what the thread owned) and never lets the thread die silently.

``unhealthy_reason()`` is None while healthy; ``snapshot()`` is what ``/get_server_info`` shows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CONSECUTIVE_LIMIT = 20


class ComponentHealth:
    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0
        self.last_error: str | None = None
        self._consecutive = 0
        self._dead: dict[str, str] = {}
        self._lock = threading.Lock()

    def record(self, where: str, exc: BaseException) -> str:
        """Log ``exc`` (raised in ``where``) with its traceback; return the reason for a failure message."""
        reason = f"internal error in {self.name} {where}: {type(exc).__name__}: {exc}"
        log.error("lynx: %s", reason, exc_info=exc)
        with self._lock:
            self.errors += 1
            self._consecutive += 1
            self.last_error = reason
        return reason

    def ok(self) -> None:
        """An item was handled without error (ends a run of consecutive errors)."""
        if self._consecutive:
            with self._lock:
                self._consecutive = 0

    def thread(self, name: str, body: Callable[[], None], closing: Callable[[], bool],
               on_death: Callable[[str], None] | None = None) -> Callable[[], None]:
        """A thread target that runs ``body`` and reports it if it ends while not ``closing()``."""

        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - the thread must not end unreported
                reason = self.record(f"thread {name}", exc)
                self._died(name, f"{name} thread stopped: {reason}", on_death)
                return
            if not closing():
                self._died(name, f"{name} thread returned while the component was not closing", on_death)

        return run

    def _died(self, name: str, reason: str, on_death: Callable[[str], None] | None) -> None:
        log.error("lynx: %s is unhealthy: %s", self.name, reason)
        with self._lock:
            self._dead[name] = reason
        if on_death is not None:
            try:
                on_death(reason)
            except Exception:
                log.exception("lynx: %s: failing the work of a dead thread raised", self.name)

    def dead_reason(self) -> str | None:
        """Why a thread of the component has stopped (set before its work is failed), None while all run."""
        with self._lock:
            return "; ".join(self._dead.values()) if self._dead else None

    def unhealthy_reason(self) -> str | None:
        with self._lock:
            if self._dead:
                return "; ".join(self._dead.values())
            if self._consecutive >= CONSECUTIVE_LIMIT:
                return f"{self._consecutive} consecutive internal errors, last: {self.last_error}"
        return None

    def snapshot(self) -> dict[str, Any]:
        return {"unhealthy_reason": self.unhealthy_reason(), "internal_errors": self.errors,
                "last_internal_error": self.last_error}
