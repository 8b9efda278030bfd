"""A timeline trace of the transfer path, for finding where a request's time goes.

Off by default: every call is one attribute check. ``SGLANG_LYNX_TRACE_DIR=DIR`` in a server's
environment switches it on: each process appends one JSON object per line to
``DIR/lynx-trace-<pid>.jsonl``::

    {"t": 1765065600.123456, "ev": "issue", "thread": "lynx-send", "rid": "123", "kind": "anchor", "bytes": 4096}

``t`` is wall-clock time (``time.time()``), so the lines of the processes of one host (a prefill and a
decode server, the benchmark client) order against each other. Events (what emits them):

- ``forward_begin`` / ``layers_queued`` / ``forward_end``: the prefill's forward of a layered request
  (``integration/transport/prefill_layers.py``: each group of layers copied and its part queued);
- ``encode``: one part's (or a whole request's) encode on the encode thread, ``dur`` seconds, ``final``;
- ``issue`` / ``done``: one chunk handed to the engine / seen finished by the sender thread (``kind``,
  ``bytes``; ``done`` has ``wire_s``, the time from issue);
- ``land``: a stream landed, as the sender sees it; ``recv_land`` the same as the decode side sees it;
- ``admit``: the decode scheduler admitted the request on its anchor.

Bounded: at most ``max_events`` lines per process (then one ``truncated`` line and nothing more), and
a write error switches the trace off (it never fails a request). Writes are line-buffered and taken
under one lock, so a killed server leaves whole lines behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

TRACE_ENV = "SGLANG_LYNX_TRACE_DIR"
MAX_EVENTS = 200_000


class Trace:
    """One process's trace sink (see the module docstring); ``enabled`` False makes ``emit`` a no-op."""

    def __init__(self, directory: str | os.PathLike[str] | None, max_events: int = MAX_EVENTS) -> None:
        self.enabled = directory is not None and str(directory) != ""
        self.max_events, self.events = max_events, 0
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if self.enabled:
            assert directory is not None
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.path: Path | None = Path(directory) / f"lynx-trace-{os.getpid()}.jsonl"
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (the process's life)
        else:
            self.path = None

    def emit(self, event: str, **fields: Any) -> None:
        """Append one event (``fields`` must be JSON-serialisable; anything else is written as its repr)."""
        if not self.enabled:
            return
        line = {"t": time.time(), "ev": event, "thread": threading.current_thread().name, **fields}
        with self._lock:
            if self._file is None:
                return
            try:
                if self.events >= self.max_events:
                    self._file.write(json.dumps({"t": time.time(), "ev": "truncated"}) + "\n")
                    self._close()
                    return
                self._file.write(json.dumps(line, default=repr) + "\n")
                self.events += 1
            except (OSError, ValueError):  # disk full, closed: the trace goes, the server stays
                self._close()

    def _close(self) -> None:
        self.enabled = False
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def close(self) -> None:
        with self._lock:
            self._close()


_process_trace: Trace | None = None
_process_lock = threading.Lock()


def trace() -> Trace:
    """The process's trace, made from ``SGLANG_LYNX_TRACE_DIR`` at the first call."""
    global _process_trace
    if _process_trace is None:
        with _process_lock:
            if _process_trace is None:
                _process_trace = Trace(os.environ.get(TRACE_ENV))
    return _process_trace
