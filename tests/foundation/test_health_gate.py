"""The health gate (``integration/platform/health_gate.py``) on a real Starlette app: the health paths
answer 503 with the reason while a scheduler's Lynx block is unhealthy, pass through otherwise (also
when the state cannot be read in time), and every other path is untouched. The gate in a running
server is exercised by the fault matrix (``test_decode_killed_while_drafting``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from sglang_lynx.integration.platform import health_gate
from sglang_lynx.integration.platform.health_gate import add_health_gate, unhealthy_reasons


def _app(states: Any) -> TestClient:
    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("sglang says ok")

    app = Starlette(routes=[Route(p, ok) for p in ("/health", "/health_generate", "/generate")])

    async def get_states() -> list[Any]:
        if isinstance(states, BaseException):
            raise states
        if states == "hang":
            await asyncio.sleep(60)
        return list(states)

    add_health_gate(app, get_states)
    return TestClient(app)


HEALTHY = [{"lynx": {"unhealthy_reason": None, "internal_errors": 0}}]
SICK = [{"lynx": {"unhealthy_reason": "lynx-control thread stopped: boom"}}, {"other": 1}]


def test_unhealthy_reasons_reads_every_scheduler_block() -> None:
    assert unhealthy_reasons(HEALTHY) == []
    assert unhealthy_reasons(SICK) == ["lynx-control thread stopped: boom"]
    assert unhealthy_reasons([{}, "not a dict", {"lynx": "odd"}]) == []


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_an_unhealthy_lynx_side_fails_the_health_paths_with_the_reason(path: str) -> None:
    response = _app(SICK).get(path)
    assert response.status_code == 503
    assert response.text == "sglang-lynx: unhealthy: lynx-control thread stopped: boom"


def test_a_healthy_side_passes_through_and_other_paths_are_untouched() -> None:
    assert _app(HEALTHY).get("/health").text == "sglang says ok"
    sick = _app(SICK)
    assert sick.get("/generate").status_code == 200


def test_a_state_that_cannot_be_read_leaves_the_decision_to_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _app(RuntimeError("scheduler gone")).get("/health").status_code == 200
    monkeypatch.setattr(health_gate, "STATE_TIMEOUT_S", 0.2)
    assert _app("hang").get("/health").status_code == 200


def test_the_gate_is_added_to_sglangs_app_once() -> None:
    from sglang.srt.entrypoints.http_server import app

    before = len(app.user_middleware)
    try:
        health_gate.install_health_gate()
        health_gate.install_health_gate()
        assert len(app.user_middleware) == before + 1
    finally:
        del app.user_middleware[before:]
        app.state.lynx_health_gate = False
