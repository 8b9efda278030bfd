"""Writes given up on at their deadline, kept until the engine finishes them or a hold passes.

A chunk whose deadline passes while Mooncake still reports it pending is *abandoned*: its stream
fails at once (the receiver learns it from the ``failed`` notice), but its bytes may still cross the
wire, so the request is not ``quiet`` and its send region is not reused. This ledger, owned by the
scheduler's sender thread, settles each abandoned write:

- **settled**: the engine reports the write finished (done or failed): the write is gone; the
  request's ``abandoned_chunks`` drops by one and it may become quiet;
- **forgotten**: ``hold_s`` passed and the engine still says pending: the write is counted in
  :attr:`AbandonedWrites.forgotten`, handed to ``forget`` (the engine stops watching it too) and
  released the same way. The receiver quarantines a failed
  region for ``transfer_timeout_s`` (its own hold), which this hold matches: after it, neither side
  holds the bytes back. Without this bound one stuck engine entry (seen after a sender was stopped
  and resumed) kept a send region and a ``transfer in progress`` forever.

Checks run at most every ``check_interval_s`` so a long ledger never slows the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_lynx.transfer.progress import RequestTransfer

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    transfer: RequestTransfer
    handle: Any
    given_up_at: float


class AbandonedWrites:
    def __init__(self, settled: Callable[[Any], bool], hold_s: float, check_interval_s: float = 0.1,
                 forget: Callable[[Any], None] | None = None) -> None:
        if not hold_s > 0 or not check_interval_s > 0:
            raise ValueError(f"AbandonedWrites: hold_s ({hold_s}) and check_interval_s ({check_interval_s}) "
                             "must be > 0")
        self._settled, self.hold_s, self.check_interval_s = settled, hold_s, check_interval_s
        self._forget = forget
        self._entries: list[_Entry] = []
        self._next_check = 0.0
        self.settled_count = 0
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, transfer: RequestTransfer, handle: Any, now: float) -> None:
        transfer.abandoned_chunks += 1
        self._entries.append(_Entry(transfer, handle, now))

    def check(self, now: float) -> list[RequestTransfer]:
        """Settle or forget what is due; return the transfers whose count dropped (to re-check quiet)."""
        if not self._entries or now < self._next_check:
            return []
        self._next_check = now + self.check_interval_s
        released: list[RequestTransfer] = []
        still: list[_Entry] = []
        for entry in self._entries:
            if self._settled(entry.handle):
                self.settled_count += 1
            elif now - entry.given_up_at > self.hold_s:
                self.forgotten += 1
                if self._forget is not None:
                    self._forget(entry.handle)
                log.warning("lynx: request %s: a write abandoned %.0f s ago is still pending in the engine; "
                            "releasing its send region (the receiver's quarantine has passed too)",
                            entry.transfer.request_id, now - entry.given_up_at)
            else:
                still.append(entry)
                continue
            entry.transfer.abandoned_chunks -= 1
            released.append(entry.transfer)
        self._entries = still
        return released
