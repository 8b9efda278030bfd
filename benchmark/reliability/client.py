"""The soak's HTTP client side: bounded POST / GET, the idle and health checks, the prompts."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sglang_lynx.launch.server_state import idle_problems, lynx_state


def post(url: str, payload: dict[str, Any], timeout: float) -> tuple[int | None, Any, bool]:
    """(status, body, timed out); status None: no HTTP answer."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return 200, json.loads(resp.read()), False
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(raw), False
        except json.JSONDecodeError:
            return exc.code, raw, False
    except TimeoutError as exc:
        return None, repr(exc), True
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, repr(exc), "timed out" in str(exc)


def get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def wait_idle(url: str, baseline: dict[str, Any], timeout_s: float) -> tuple[list[str], float]:
    started = time.monotonic()
    problems: list[str] = []
    while time.monotonic() - started < timeout_s:
        problems = idle_problems(lynx_state(url), baseline)
        if not problems:
            break
        time.sleep(1.0)
    return problems, round(time.monotonic() - started, 1)


def health_generate(url: str, timeout_s: float = 120.0) -> str:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if get_status(f"{url}/health_generate") == 200:
            return f"ok ({time.monotonic() - started:.1f} s)"
        time.sleep(2)
    return "no answer"


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def make_prompts(n: int, lo: int, hi: int) -> list[str]:
    from sglang_lynx.launch.client import haystack

    sizes = [int(lo + (hi - lo) * i / max(n - 1, 1)) for i in range(n)]
    return [" ".join(haystack(size, seed=100 + i)) + "\nQuestion: which log mentions the tides? Answer:"
            for i, size in enumerate(sizes)]
