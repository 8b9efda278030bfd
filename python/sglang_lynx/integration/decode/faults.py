"""Test-only faults on the decode server's Lynx handling of one request.

Inert unless the decode server runs with ``SGLANG_LYNX_TEST_HOOKS=1`` (``decode.tracked.test_params``
reads nothing otherwise). A request asks for one through
``sampling_params.custom_params["lynx_test_decode_fault"]``:

- ``raise_in_upgrade``: the in-place KV upgrade of THIS request raises (before the pool is touched);
- ``raise_in_verify``: its chain verify raises (before the verify pass);
- ``stop_control_thread``: on admission, the decode side's control thread is stopped (it returns
  while the server is not closing): the transport is unhealthy from then on, ``/health`` answers 503
  with the reason (``platform.health_gate``); only a restart heals it.

The per-request isolation (``decode.scheduler`` / ``decode.actions``) must turn the first two into a
500 for that request alone, the other requests and the server going on.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_lynx.integration.decode.tracked import test_params

logger = logging.getLogger("sglang_lynx.decode")

DECODE_FAULT_KEY = "lynx_test_decode_fault"
DECODE_FAULTS = ("raise_in_upgrade", "raise_in_verify", "stop_control_thread")


class LynxTestFault(RuntimeError):
    """The error a test fault raises (never raised without the test hooks)."""


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
    """``stop_control_thread``: stop the decode side's control thread as a crash would."""
    if decode_fault_of(req) == "stop_control_thread":
        logger.warning("lynx test fault: request %s: stopping the control thread", req.rid)
        side.control._stop.set()  # the thread returns while not closing: unhealthy (transfer/health.py)
