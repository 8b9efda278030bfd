"""The health gate (``integration/platform/health_gate.py``) on a real Starlette app: once the
background read has recorded an unhealthy Lynx block, the health paths answer 503 with the reason at
once; they pass through while healthy, before the first read, while the read hangs or fails, and when
the record went stale; every other path is untouched. The gate in a running server is exercised by the
fault matrix (``test_decode_killed_while_drafting``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from sglang_lynx.integration.platform import health_gate
from sglang_lynx.integration.platform.health_gate import add_health_gate, unhealthy_reasons

HEALTHY = [{"lynx": {"unhealthy_reason": None, "internal_errors": 0}}]
SICK = [{"lynx": {"unhealthy_reason": "lynx-control thread stopped: boom"}}, {"other": 1}]


@pytest.fixture(autouse=True)
def fast_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health_gate, "REFRESH_S", 0.02)


def _client(script: list[Any]) -> tuple[TestClient, list[int]]:
    """An app whose state reads follow ``script`` (the last entry repeats): a list of states, an
    exception to raise, or "hang"; also returns the count of reads done."""
    reads = [0]

    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("sglang says ok")

    app = Starlette(routes=[Route(p, ok) for p in ("/health", "/health_generate", "/generate")])

    async def get_states() -> list[Any]:
        step = script[min(reads[0], len(script) - 1)]
        reads[0] += 1
        if isinstance(step, BaseException):
            raise step
        if step == "hang":
            await asyncio.sleep(3600)
        return list(step)

    add_health_gate(app, get_states)
    return TestClient(app), reads


def _after_reads(client: TestClient, reads: list[int], n: int, path: str = "/health") -> Any:
    client.get("/generate")  # the first request starts the background read
    deadline = time.monotonic() + 10
    while reads[0] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reads[0] >= n
    return client.get(path)


def test_unhealthy_reasons_reads_every_scheduler_block() -> None:
    assert unhealthy_reasons(HEALTHY) == []
    assert unhealthy_reasons(SICK) == ["lynx-control thread stopped: boom"]
    assert unhealthy_reasons([{}, "not a dict", {"lynx": "odd"}]) == []


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_an_unhealthy_lynx_side_fails_the_health_paths_with_the_reason(path: str) -> None:
    with _client([SICK])[0] as client:
        response = None
        for _ in range(200):  # the record is filled in the background
            response = client.get(path)
            if response.status_code == 503:
                break
            time.sleep(0.02)
        assert response is not None and response.status_code == 503
        assert response.text == "sglang-lynx: unhealthy: lynx-control thread stopped: boom"


def test_a_healthy_side_passes_through_and_other_paths_are_untouched() -> None:
    client, reads = _client([HEALTHY])
    with client:
        assert _after_reads(client, reads, 2).text == "sglang says ok"
    client, reads = _client([SICK])
    with client:
        assert _after_reads(client, reads, 2, "/generate").status_code == 200


def test_no_fresh_record_leaves_the_decision_to_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    client, reads = _client([RuntimeError("scheduler gone")])
    with client:
        assert _after_reads(client, reads, 2).status_code == 200
    client, reads = _client(["hang"])
    with client:
        assert _after_reads(client, reads, 1).status_code == 200
    monkeypatch.setattr(health_gate, "STALE_S", 0.2)
    client, reads = _client([SICK, "hang"])  # one unhealthy read, then the scheduler stops answering
    with client:
        first = _after_reads(client, reads, 2)
        time.sleep(0.3)
        assert (first.status_code, client.get("/health").status_code) == (503, 200)


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
