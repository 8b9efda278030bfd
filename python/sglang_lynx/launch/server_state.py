"""A Lynx server's occupancy, read from outside: the ``lynx`` block of SGLang's ``/get_server_info``.

The block (written by the Lynx KV manager, see ``integration/transport/kv_manager.py``) names the server's
role, its staging arena (bytes free of the arena, leases, quarantine), the requests the transport
still tracks, the bytes registered with Mooncake and, on a decode server, the KV pool's free tokens.
A server is *idle* when all of that is back at the values it had before any request
(:func:`idle_problems` against a baseline read at start). Used by the fault-matrix tests and the soak.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

#: Counters that must be zero (or empty) on an idle server.
IDLE_KEYS = ("inbound_requests", "tracked_requests", "pending_requests", "transfers_in_progress")


def lynx_state(url: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """The ``lynx`` block of ``{url}/get_server_info`` (first scheduler), or None if unreadable."""
    try:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=timeout) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return (info.get("internal_states") or [{}])[0].get("lynx")


def idle_problems(state: dict[str, Any] | None, baseline: dict[str, Any]) -> list[str]:
    """Why ``state`` is not back at the idle ``baseline`` (an empty list: idle)."""
    if state is None:
        return ["no lynx state"]
    problems = []
    staging = state["staging"]
    if staging["free_bytes"] != staging["arena_bytes"] or staging["leases"] or staging.get("waiting"):
        problems.append(f"staging {staging}")
    if state["registered_bytes"] != baseline["registered_bytes"]:
        problems.append(f"registered {state['registered_bytes']} != {baseline['registered_bytes']}")
    problems += [f"{key}={state[key]}" for key in IDLE_KEYS if state.get(key)]
    if state.get("live_transfers"):  # a prefill's unfinished sends: where each one stands
        problems.append(f"live transfers {state['live_transfers']}")
    if state["role"] == "decode" and state["kv_pool_free_tokens"] != baseline["kv_pool_free_tokens"]:
        problems.append(f"kv pool free {state['kv_pool_free_tokens']} != idle {baseline['kv_pool_free_tokens']}")
    return problems
