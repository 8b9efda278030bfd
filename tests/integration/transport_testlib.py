"""Helpers shared by the real-transport tests (both Lynx sides on loopback, no SGLang)."""

from __future__ import annotations

import time
from typing import Any

from sglang_lynx.integration.transport.decode_side import LynxDecodeSide, Verdict
from sglang_lynx.integration.transport.prefill_side import LynxPrefillSide


def poll_until_final(decode: LynxDecodeSide, room: int, need_residual: bool,
                     bound_s: float = 120.0) -> tuple[Verdict, str]:
    """The decode side's verdict on ``room`` once it is no longer pending (bounded)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        verdict, why = decode.poll(room, need_residual=need_residual)
        if verdict is not Verdict.PENDING:
            return verdict, why
        time.sleep(0.01)
    raise AssertionError(f"request {room} still pending after {bound_s} s")


def wait_idle(prefill: LynxPrefillSide, decode: LynxDecodeSide, bound_s: float = 30.0) -> None:
    """Both arenas free again: the prefill's region on quiet, the decode's on finish or after quiet."""
    deadline = time.monotonic() + bound_s
    snapshot: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snapshot = {"prefill": prefill.snapshot()["staging"], "decode": decode.snapshot()["staging"]}
        if all(s["free_bytes"] == s["arena_bytes"] and s["leases"] == 0 for s in snapshot.values()):
            return
        time.sleep(0.05)
    raise AssertionError(f"staging not free after {bound_s} s: {snapshot}")


def thread_stacks(prefix: str = "lynx") -> str:
    """Where this process's threads named ``prefix...`` are now (what a timing-out test reports)."""
    import sys
    import threading
    import traceback

    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if thread.name.startswith(prefix) and frame is not None:
            out.append(f"-- {thread.name}:\n" + "".join(traceback.format_stack(frame, limit=8)))
    return "\n".join(out)
