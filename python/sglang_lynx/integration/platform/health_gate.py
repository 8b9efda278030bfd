"""``/health`` and ``/health_generate`` fail while a Lynx transport component is unhealthy.

Lifecycle: installed once in the launcher process of a ``--lynx`` server (the one that serves HTTP),
after ``Engine._launch_subprocesses`` started the schedulers and before uvicorn starts the app (a
Starlette middleware cannot be added later). The first request the app sees starts one background
task in its event loop that reads the schedulers' internal state every ``REFRESH_S`` (the same call
as ``/get_server_info``; the Lynx block is added by ``transport.kv_manager``) and keeps the
``unhealthy_reason`` of every scheduler whose Lynx block has one. A health request is answered from
that record at once, never waiting on a scheduler: **503** with ``sglang-lynx: unhealthy: <reason>``
when a reason is recorded (a transport thread that died, a run of internal errors:
``transfer/health.py``); otherwise, or when the record is older than ``STALE_S`` (a busy or stuck
scheduler: SGLang's own health check then decides), it goes on to SGLang's handler unchanged. A read
is never cancelled (SGLang's request/response communicator must not lose a reply). Every other path
is untouched. With ``--tokenizer-worker-num`` > 1 uvicorn imports the app afresh in each worker
process, where this middleware is not added: the health endpoints then answer as in stock SGLang (the
reason is still in ``/get_server_info``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

logger = logging.getLogger("sglang_lynx")

HEALTH_PATHS = frozenset({"/health", "/health_generate"})
REFRESH_S = 5.0
STALE_S = 30.0
APP_TARGET = "sglang.srt.entrypoints.http_server.app"


def unhealthy_reasons(internal_states: Iterable[Any]) -> list[str]:
    """The ``unhealthy_reason`` of every scheduler whose Lynx block has one (in order)."""
    reasons = []
    for state in internal_states:
        lynx = state.get("lynx") if isinstance(state, dict) else None
        reason = lynx.get("unhealthy_reason") if isinstance(lynx, dict) else None
        if reason:
            reasons.append(str(reason))
    return reasons


class HealthRecord:
    """The latest unhealthy reasons read from the schedulers, and when (monotonic seconds)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.read_at: float | None = None

    def current(self, now: float) -> list[str]:
        """The recorded reasons, or none when nothing fresh was read (SGLang decides then)."""
        if self.read_at is None or now - self.read_at > STALE_S:
            return []
        return self.reasons


class HealthGate:
    """A pure ASGI middleware: the health paths are answered 503 while the record names an unhealthy
    Lynx side; every other request goes straight to the app (no wrapping of its body or its
    disconnect detection, which SGLang's streaming ``/generate`` relies on)."""

    def __init__(self, app: Any, get_states: Callable[[], Awaitable[list[Any]]]) -> None:
        self.app = app
        self.get_states = get_states
        self.record = HealthRecord()
        self._poller: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._poller is None and scope.get("type") in ("http", "lifespan"):
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        if scope.get("type") == "http" and scope.get("path") in HEALTH_PATHS:
            reasons = self.record.current(time.monotonic())
            if reasons:
                from starlette.responses import PlainTextResponse

                response = PlainTextResponse("sglang-lynx: unhealthy: " + "; ".join(reasons), status_code=503)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _poll(self) -> None:
        while True:
            try:
                states = await self.get_states()  # never cancelled: see the module docstring
                self.record.reasons, self.record.read_at = unhealthy_reasons(states), time.monotonic()
            except Exception as exc:  # a failing read leaves the record to go stale
                logger.warning("sglang-lynx: health gate could not read the scheduler state (%s)", exc)
            await asyncio.sleep(REFRESH_S)


def add_health_gate(app: Any, get_states: Callable[[], Awaitable[list[Any]]]) -> None:
    """Add the gate on ``get_states`` to a Starlette / FastAPI ``app`` that has not started yet."""
    app.add_middleware(HealthGate, get_states=get_states)


def install_health_gate() -> None:
    """Add the gate to SGLang's HTTP app (launcher process, before the app starts; idempotent)."""
    from sglang_lynx.integration.hook_targets import TARGETS, resolve

    assert APP_TARGET in TARGETS
    app = resolve(APP_TARGET)
    if getattr(app.state, "lynx_health_gate", False):
        return

    async def get_states() -> list[Any]:
        import sglang.srt.entrypoints.http_server as http_server  # its _global_state is set at launch

        manager = getattr(http_server._global_state, "tokenizer_manager", None)
        if manager is None:
            return []
        return list(await manager.get_internal_state())

    add_health_gate(app, get_states)
    app.state.lynx_health_gate = True
