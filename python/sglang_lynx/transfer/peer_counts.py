"""Per-peer request counts for xPyD deployments, read through ``/get_server_info``.

A prefill server counts the requests it handed to its transfer scheduler per decode peer (control
endpoint); a decode server counts the requests it expected per prefill (bootstrap address) and the
most prefills it had requests in flight from at one time. Bounded: beyond ``max_peers`` the peer
counted longest ago is dropped (its count is folded into ``dropped``). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any


class PeerCounts:
    def __init__(self, max_peers: int = 64) -> None:
        if max_peers < 1:
            raise ValueError(f"PeerCounts: max_peers must be >= 1, got {max_peers}")
        self.max_peers = max_peers
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._active: Counter[str] = Counter()
        self.dropped = 0
        self.peak_at_once = 0
        self._lock = threading.Lock()

    def start(self, peer: str | None) -> None:
        """One request from/to ``peer`` begins (it counts, and is in flight until :meth:`end`)."""
        key = peer or "?"
        with self._lock:
            self._counts[key] = self._counts.pop(key, 0) + 1
            while len(self._counts) > self.max_peers:
                _, count = self._counts.popitem(last=False)
                self.dropped += count
            self._active[key] += 1
            self.peak_at_once = max(self.peak_at_once, len(self._active))

    def end(self, peer: str | None) -> None:
        """The request from/to ``peer`` is over (idempotent per start: never below zero)."""
        key = peer or "?"
        with self._lock:
            if self._active[key] <= 1:
                self._active.pop(key, None)
            else:
                self._active[key] -= 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self._counts), "in_flight": dict(self._active),
                    "peak_peers_at_once": self.peak_at_once, "dropped": self.dropped}
