"""Requests straight to a PD pair, as the router sends them, and the decode server's settled state."""

from __future__ import annotations

import random
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_lynx.launch.client import post_json
from sglang_lynx.launch.server_state import IDLE_KEYS, lynx_state


def pd_generate(deployment: Any, payload: dict[str, Any], timeout: float = 600.0, *, prefill: int = 0,
                decode: int = 0, room: int | None = None) -> dict[str, Any]:
    """One request to prefill ``prefill`` and decode ``decode`` with that prefill's bootstrap host and port
    and a fresh room (or ``room``), as the router sends it; the decode server answers. The router is
    bypassed because it drops ``sampling_params.custom_params``, which carries the test holds."""
    prefill_urls = getattr(deployment, "prefill_urls", None) or [deployment.prefill_url]
    decode_urls = getattr(deployment, "decode_urls", None) or [deployment.decode_url]
    bootstrap_ports = getattr(deployment, "bootstrap_ports", None) or [deployment.bootstrap_port]
    bootstrap_host = urllib.parse.urlparse(prefill_urls[prefill]).hostname  # the prefill's (a namespace's) address
    request = {**payload, "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_ports[prefill],
               "bootstrap_room": random.randint(0, 2**63 - 1) if room is None else room}
    with ThreadPoolExecutor(2) as pool:
        sent = pool.submit(post_json, f"{prefill_urls[prefill]}/generate", request, timeout)
        answer = pool.submit(post_json, f"{decode_urls[decode]}/generate", request, timeout)
        result = answer.result()
        sent.result()
    return result


def pd_generate_side_by_side(first: tuple[Any, dict[str, Any]], second: tuple[Any, dict[str, Any]],
                             timeout: float = 600.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two requests at once, each ``(deployment, payload)`` to its own pair: the reference and the request
    under test of a comparison. Each pair still serves one request at a time (what a greedy comparison in
    bf16 needs); the two only share the host's cores, which they leave partly idle one at a time."""
    if first[0] is second[0]:
        raise ValueError("side by side requests go to two deployments (one request at a time on each)")
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(pd_generate, *first, timeout)
        b = pool.submit(pd_generate, *second, timeout)
        return a.result(), b.result()


def last(meta: dict[str, Any], key: str) -> Any:
    """A ``lynx_*`` meta field's final value (they come one per output token)."""
    value = meta.get(key)
    if isinstance(value, list):
        return value[-1] if value else None
    return value


def settled_state(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The decode server's Lynx state once no request is in flight and the free KV count is stable
    over two reads (a finished request's own slots are released just after its last chunk)."""
    deadline = time.monotonic() + timeout_s
    previous: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        state = lynx_state(url)
        if state is not None and not any(state.get(k) for k in IDLE_KEYS):
            if previous is not None and previous["kv_pool_free_tokens"] == state["kv_pool_free_tokens"]:
                return state
            previous = state
        time.sleep(1.0)
    raise AssertionError(f"the decode server did not settle within {timeout_s} s: {lynx_state(url)}")
