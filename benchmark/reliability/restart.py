"""The soak's peer restart: kill the prefill mid-load, start it again on the same ports, resume the load.

Lifecycle (one thread, :meth:`PrefillRestart.run`): wait until ``at_s`` after the soak's start; close the
gate (clients take no new request: the ones in flight keep going); note ``kill_s`` and SIGKILL the
prefill's process group (``PDDeployment.restart_prefill``: decode and router keep running); start it
again with the same command; once it answers ``/health``, send one-token requests through the router
until one succeeds (the router may have opened its circuit breaker meanwhile); note ``ready_s`` and open
the gate; then wait for ``release`` (set once the deployment is down): the new prefill was started
from this thread, and the kernel kills it when this thread exits (``PR_SET_PDEATHSIG`` follows the
forking thread; seen: the new prefill died silently the moment a returning restart thread ended). A
restart that fails (the prefill does not come back, or the router does not route within
``timeout_s``) sets ``error`` and the soak's ``stop`` event: the run ends and fails.

The router runs without its circuit breaker (``--disable-circuit-breaker``; ``--router-circuit-breaker``
keeps it): with one prefill it has nowhere to fail over, and it turned the restart into a longer outage.
Seen with it on (sglang_router 0.3.2): the failures of the requests in flight at the kill opened the
prefill's circuit; 60 s later, with the new prefill healthy, the first request routed, the next one went
over the router's pooled keep-alive connection to the *dead* process ("Prefill server failed (CRITICAL)
... error sending request"), the half-open circuit opened again, and every request was refused at once
("No available prefill workers (all circuits open or unhealthy)") for another 60 s, and so on.

Requests are then in phase ``before`` (answered before the kill), ``in_flight`` (started before the pair
was back, answered after the kill: a clear error or a correct answer, nothing else), ``after`` (started
once it routed again: held to the ordinary rules).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


def phase_of(started_s: float, ended_s: float, kill_s: float | None, ready_s: float | None,
             planned: bool) -> str:
    """A request's phase against the restart (times in seconds since the soak's start); ``planned``: this
    run restarts the prefill at all (``-`` when not)."""
    if not planned:
        return "-"
    if kill_s is None or ended_s <= kill_s:
        return "before"
    if ready_s is not None and started_s >= ready_s:
        return "after"
    return "in_flight"


@dataclass
class PrefillRestart:
    pair: Any  # a started PDDeployment
    at_s: float
    t0: float  # the soak's start (time.monotonic())
    stop: threading.Event
    timeout_s: float = 600.0
    gate: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)  # the deployment is down: may exit
    kill_s: float | None = None
    healthy_after_s: float | None = None
    ready_s: float | None = None
    in_flight_at_kill: int = 0
    error: str = ""
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.gate.set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def enter(self) -> bool:
        """A client about to send a request: wait while the gate is closed (bounded); False: stop."""
        while not self.gate.wait(1.0):
            if self.stop.is_set():
                return False
        if self.stop.is_set():
            return False
        with self._lock:
            self._in_flight += 1
        return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def phase(self, started_s: float, ended_s: float) -> str:
        return phase_of(started_s, ended_s, self.kill_s, self.ready_s, planned=True)

    def run(self) -> None:
        if self.stop.wait(max(self.at_s - self.now(), 0.0)):
            return
        self.gate.clear()
        with self._lock:
            self.in_flight_at_kill = self._in_flight
            self.kill_s = self.now()
        print(f"[soak] {self.kill_s:.0f} s: killing the prefill ({self.in_flight_at_kill} requests in flight)",
              flush=True)
        try:
            self.healthy_after_s = round(self.pair.restart_prefill(self.timeout_s), 1)
            print(f"[soak] prefill healthy again after {self.healthy_after_s} s", flush=True)
            self.pair.wait_routable(max(self.timeout_s - self.healthy_after_s, 60.0))
        except Exception as exc:  # the run fails; the deployment is torn down by the caller
            self.error = f"restart failed: {exc}"[:2000]
            print(f"[soak] {self.error}", flush=True)
            self.stop.set()
            self.gate.set()
            return
        self.ready_s = self.now()
        print(f"[soak] {self.ready_s:.0f} s: routing again ({self.ready_s - self.kill_s:.1f} s after the kill)",
              flush=True)
        self.gate.set()
        self.release.wait()  # keep the thread that started the new prefill alive as long as the prefill

    def report(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "kill_s": None if self.kill_s is None else round(self.kill_s, 1),
                "in_flight_at_kill": self.in_flight_at_kill, "prefill_healthy_after_s": self.healthy_after_s,
                "routable_after_kill_s": None if self.ready_s is None or self.kill_s is None
                else round(self.ready_s - self.kill_s, 1),
                "done": self.ready_s is not None, "error": self.error}
