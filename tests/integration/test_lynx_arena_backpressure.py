"""Staging back-pressure in a real PD pair (mode ``lynx``, real SGLang, real Mooncake on loopback).

The pair's Lynx arenas are sized to hold one (prefill send arena, 26 MiB) and two (decode receive
arena, 40 MiB) of the ~1,500-token requests (~19 MB of streams each), just above the start-up floor
of one max-context request (``--context-length 2048``: ~26 MB). Six such requests are sent at once:
every one completes, none fails for space (the decode holds SGLang's metadata back until its region
is reserved, the prefill waits for its send region; FIFO, bounded by ``transfer_timeout_s``), each
output equals the same request sent alone, the decode side did make requests wait, and afterwards
both servers are idle (staging all free with nobody waiting, no request tracked, KV pool back).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS
from pd_requests import pd_generate
from sglang_lynx.launch.client import haystack
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.server_state import IDLE_KEYS, idle_problems, lynx_state

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIG = {"mode": "lynx", "send_arena_mb": 26, "receive_arena_mb": 40, "transfer_timeout_s": 240.0,
          "residual_timeout_s": 60.0}
SERVER_ARGS = [*TEST_SERVER_ARGS, "--dtype", "float32", "--disable-overlap-schedule", "--context-length", "2048",
               "--lynx", "--lynx-config", json.dumps(CONFIG)]
REQUESTS = 6
MAX_NEW = 12
PROMPTS = [" ".join(haystack(1150, seed=100 + i)) + f"\nQuestion {i}: which log mentions the tides? Answer:"
           for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def pair(model_path: str, deployment_logs: Path) -> Iterator[PDDeployment]:
    deployment = PDDeployment(model_path, extra_args=SERVER_ARGS, log_dir=deployment_logs / "pd-lynx-backpressure")
    with deployment:
        deployment.start(timeout_s=START_TIMEOUT_S)
        yield deployment


def _generate(pair: PDDeployment, prompt: str, timeout: float = 600.0) -> dict[str, Any]:
    """Straight to both servers, as the router sends it (bootstrap host, port, a fresh room)."""
    payload = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
    return pd_generate(pair, payload, timeout)


def _settled(url: str, baseline: dict[str, Any], timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    problems = ["never read"]
    while time.monotonic() < deadline:
        state = lynx_state(url)
        problems = idle_problems(state, baseline)
        if not problems:
            return []
        time.sleep(1.0)
    return problems


def _quiet(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The server's Lynx state once nothing is in flight and the free KV count is stable over two reads."""
    deadline = time.monotonic() + timeout_s
    previous: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        state = lynx_state(url)
        if state is not None and not any(state.get(k) for k in IDLE_KEYS):
            if previous is not None and previous.get("kv_pool_free_tokens") == state.get("kv_pool_free_tokens"):
                return state
            previous = state
        time.sleep(1.0)
    raise AssertionError(f"{url} did not settle within {timeout_s} s: {lynx_state(url)}")


def test_more_concurrent_long_requests_than_the_arenas_hold_all_complete_correctly(pair: PDDeployment) -> None:
    urls = {"prefill": pair.prefill_url, "decode": pair.decode_url}
    alone = []
    for prompt in PROMPTS:  # the reference: one by one (never waits for space)
        out = _generate(pair, prompt)
        alone.append(out)
        assert out["meta_info"]["finish_reason"]["type"] != "abort", out["meta_info"]
    tokens = [out["meta_info"]["prompt_tokens"] for out in alone]
    assert all(1300 <= n <= 1800 for n in tokens), tokens
    baseline = {name: _quiet(url) for name, url in urls.items()}
    assert baseline["prefill"]["staging"]["arena_bytes"] == 26 << 20
    assert baseline["decode"]["staging"]["arena_bytes"] == 40 << 20
    waits_before = {name: state["staging"]["waits"] for name, state in baseline.items()}

    t0 = time.monotonic()
    with ThreadPoolExecutor(REQUESTS) as pool:
        flood = list(pool.map(lambda p: _generate(pair, p), PROMPTS))
    seconds = time.monotonic() - t0
    for i, (got, want) in enumerate(zip(flood, alone, strict=True)):
        assert got["meta_info"]["finish_reason"]["type"] != "abort", (i, got["meta_info"]["finish_reason"])
        assert got["output_ids"] == want["output_ids"], (i, got["text"], want["text"])

    for name, url in urls.items():
        assert _settled(url, baseline[name]) == [], name
    waits = {name: lynx_state(url)["staging"]["waits"] - waits_before[name]  # type: ignore[index]
             for name, url in urls.items()}
    print(f"\n[backpressure] {REQUESTS} x {tokens} tokens at once: {seconds:.1f} s; requests that waited "
          f"for staging: {waits}")
    assert waits["decode"] >= 1, waits  # the decode arena holds two of the six: back-pressure was exercised
