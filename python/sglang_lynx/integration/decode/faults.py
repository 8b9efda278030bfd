"""Test-only faults on the decode server's Lynx handling of one request.

Inert unless the decode server runs with ``SGLANG_LYNX_TEST_HOOKS=1`` (``decode.tracked.test_params``
reads nothing otherwise). A request asks for one through
``sampling_params.custom_params["lynx_test_decode_fault"]``:

- ``raise_in_upgrade``: the in-place KV upgrade of THIS request raises (before the pool is touched);
- ``raise_in_verify``: its chain verify raises (before the verify pass);
- ``stop_control_thread``: on admission, the decode side's control thread dies as a crash would (a
  ``BaseException`` its per-message guard does not catch is raised inside it): the transport is
  unhealthy from then on, ``/health`` answers 503 with the reason (``platform.health_gate``); only a
  restart heals it. (Setting the thread's stop event would be an orderly stop, reported as healthy.)

The per-request isolation (``decode.scheduler`` / ``decode.actions``) must turn the first two into a
500 for that request alone, the other requests and the server going on.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from sglang_lynx.integration.decode.tracked import test_params

logger = logging.getLogger("sglang_lynx.decode")

DECODE_FAULT_KEY = "lynx_test_decode_fault"
DECODE_FAULTS = ("raise_in_upgrade", "raise_in_verify", "stop_control_thread")


class LynxTestFault(RuntimeError):
    """The error a test fault raises (never raised without the test hooks)."""


class ControlThreadKilled(BaseException):
    """Raised inside the control thread by ``stop_control_thread``: escapes every ``except Exception``."""


def decode_fault_of(req: Any) -> str | None:
    fault = test_params(req).get(DECODE_FAULT_KEY)
    if fault is None:
        return None
    if fault not in DECODE_FAULTS:
        raise ValueError(f"{DECODE_FAULT_KEY}={fault!r}: not one of {', '.join(DECODE_FAULTS)}")
    return str(fault)


def raise_if_asked(req: Any, stage: str) -> None:
    """Raise :class:`LynxTestFault` when ``req`` asks for ``raise_in_<stage>``."""
    if decode_fault_of(req) == f"raise_in_{stage}":
        logger.warning("lynx test fault: request %s: raising in %s", req.rid, stage)
        raise LynxTestFault(f"test fault raise_in_{stage}")


def on_admission(req: Any, side: Any) -> None:
    """``stop_control_thread``: kill the decode side's control thread as a crash would."""
    if decode_fault_of(req) == "stop_control_thread":
        logger.warning("lynx test fault: request %s: killing the control thread", req.rid)
        kill_thread(side.control._thread)


def kill_thread(thread: threading.Thread) -> None:
    """Raise :class:`ControlThreadKilled` inside ``thread`` at its next Python bytecode.

    The control thread wakes from its poll at least every 200 ms, so the exception lands within that;
    ``ComponentHealth.thread`` then records the thread as dead (``transfer/health.py``).
    """
    if thread.ident is None or not thread.is_alive():
        raise RuntimeError(f"thread {thread.name} is not running")
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(ControlThreadKilled))
    if done != 1:
        raise RuntimeError(f"could not raise in thread {thread.name} (PyThreadState_SetAsyncExc -> {done})")
