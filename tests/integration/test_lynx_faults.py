"""Faults in a real Lynx PD deployment: the transfer fails cleanly, within a bound, and the decode
server keeps serving.

The Lynx streams cross a slow emulated link (application pacer, 0.02 Gb/s) so that a ~1K-token
request is still on the wire when the fault strikes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from lynx_testlib import start_pd
from sglang_lynx.launch.client import generate, needle_prompt
from sglang_lynx.launch.processes import http_ok

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

FAULT_CONFIG = json.dumps({"mode": "lynx-int8", "transfer_timeout_s": 30, "residual_timeout_s": 20})


@pytest.fixture(scope="module")
def pd_slow_link(model_path: str, deployment_logs: Path):
    os.environ["SGLANG_LYNX_LINK_GBPS"] = "0.02"
    try:
        yield from start_pd(model_path, deployment_logs / "pd-lynx-faults", FAULT_CONFIG)
    finally:
        os.environ.pop("SGLANG_LYNX_LINK_GBPS", None)


def test_prefill_killed_mid_transfer_fails_the_request_and_decode_survives(pd_slow_link) -> None:
    messages, _ = needle_prompt(1000, seed=3)
    prompt = messages[0]["content"]
    outcome: dict[str, object] = {}

    def send() -> None:
        started = time.monotonic()
        try:
            outcome["result"] = generate(pd_slow_link.url, prompt, max_new_tokens=8, timeout=300)
        except (urllib.error.URLError, OSError) as exc:
            outcome["error"] = repr(exc)
        outcome["seconds"] = time.monotonic() - started

    prefill = next(p for p in pd_slow_link.processes if p.name == "prefill")
    log_start = prefill.log_path.stat().st_size
    client = threading.Thread(target=send)
    client.start()
    deadline = time.monotonic() + 240
    # Kill the prefill server once it has computed this request's KV (its log says so).
    while time.monotonic() < deadline and "#new-token: " not in _since(prefill.log_path, log_start):
        time.sleep(0.5)
    time.sleep(2.0)
    os.killpg(prefill.popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
    client.join(timeout=300)
    assert not client.is_alive(), "the request hung after its prefill server died"
    result = outcome.get("result")
    ok_finish = isinstance(result, dict) and result.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort"
    assert "error" in outcome or ok_finish, f"a request whose KV never arrived returned tokens: {outcome}"
    decode_url = pd_slow_link.decode_url
    assert http_ok(f"{decode_url}/health", timeout=30)
    # The decode server still generates (no stale staging, no leaked state blocking it).
    assert _health_generate(decode_url)


def _since(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _health_generate(url: str) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if http_ok(f"{url}/health_generate", timeout=60):
            return True
        time.sleep(2)
    return False
