"""Test-only fault injection on the prefill (sending) side of the Lynx transport.

Inert unless the prefill server runs with ``SGLANG_LYNX_TEST_HOOKS=1``: only then is the hook that
reads a request's fault registered (AFTER ``PrefillBootstrapQueue.add``, see ``transport.kv_manager``), and
without a registered fault every function here is a no-op. A request asks for one fault through
``sampling_params.custom_params["lynx_test_prefill_fault"]`` (the name, one of :data:`FAULTS`); the
fault is keyed by the request's bootstrap room, so the next request on the same pair is unaffected.

What each fault does, always AFTER the stream's crc32 was computed from the bytes that were sent:

- ``corrupt_anchor`` / ``corrupt_residual`` / ``corrupt_exact``: once the stream has landed, one byte of
  it is flipped in the decode's staging memory (a real one-byte Mooncake write), then the landed notice
  goes out with the original crc32: the decode side must find a checksum mismatch;
- ``wrong_size_anchor`` / ``wrong_size_residual`` / ``wrong_size_exact``: the landed notice announces 64
  bytes more than were sent: the decode side must find a wrong size (``exact``: ``lynx-exact`` only);
- ``stop_before_anchor``: the prefill scheduler process stops itself (SIGSTOP) when the request's encode
  starts, before any Lynx byte is on the wire (a hung peer; a test may then kill it: "killed during the
  anchor");
- ``stop_after_anchor``: the process stops itself right after the anchor's landed notice, before any
  residual byte is issued ("hung / killed during the residual").

Not a fault but a path choice, read the same way: ``per_chunk`` keeps the request off layer groups
(``prefill_layers``), so a test reaches the per-chunk streamed path on a server with layer groups on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from typing import Any

from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind, view_at

logger = logging.getLogger("sglang_lynx.transport")

TEST_HOOKS_ENV = "SGLANG_LYNX_TEST_HOOKS"
FAULT_KEY = "lynx_test_prefill_fault"
FAULTS = ("corrupt_anchor", "corrupt_residual", "corrupt_exact", "wrong_size_anchor", "wrong_size_residual",
          "wrong_size_exact", "stop_before_anchor", "stop_after_anchor", "per_chunk")
WRONG_SIZE_EXTRA = 64


def test_hooks_enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


def fault_of(req: Any) -> str | None:
    """The fault a request asks for (None unless test hooks are on); an unknown name is refused loudly."""
    if not test_hooks_enabled():
        return None
    params = getattr(req.sampling_params, "custom_params", None) or {}
    fault = params.get(FAULT_KEY) if isinstance(params, dict) else None
    if fault is None:
        return None
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_KEY}={fault!r}: not one of {', '.join(FAULTS)}")
    return str(fault)


def stop_self(why: str) -> None:
    logger.warning("lynx test fault: stopping this process (SIGSTOP, pid %d): %s", os.getpid(), why)
    time.sleep(0.5)  # let ZMQ's I/O thread flush what was already sent
    os.kill(os.getpid(), signal.SIGSTOP)


def on_encode_start(fault: str | None, request_id: str) -> None:
    if fault == "stop_before_anchor":
        stop_self(f"request {request_id}: before the anchor")


def before_landed_notice(fault: str | None, side: Any, desc: StreamDescriptor, target: Any,
                         local_addr: int) -> StreamDescriptor:
    """Apply a corrupt / wrong-size fault to a landed stream; return the descriptor to announce."""
    if fault is None:
        return desc
    kind = desc.kind.value
    if fault == f"wrong_size_{kind}":
        logger.warning("lynx test fault: request %s: announcing %s as %d bytes (sent %d)", desc.request_id, kind,
                       desc.total_bytes + WRONG_SIZE_EXTRA, desc.total_bytes)
        return replace(desc, total_bytes=desc.total_bytes + WRONG_SIZE_EXTRA)
    if fault == f"corrupt_{kind}" and desc.total_bytes > 0:
        offset = desc.total_bytes // 2
        byte = view_at(local_addr + offset, 1)
        byte[0] ^= 0xFF  # our send copy, already checksummed; then the same byte into the peer's staging
        remote = target.regions[desc.kind].addr + offset
        side.engine.write_sync(target.session_id, local_addr + offset, remote, 1, deadline_s=10.0)
        logger.warning("lynx test fault: request %s: flipped byte %d of the landed %s stream", desc.request_id,
                       offset, kind)
    return desc


def after_landed_notice(fault: str | None, desc: StreamDescriptor) -> None:
    if fault == "stop_after_anchor" and desc.kind is StreamKind.ANCHOR:
        stop_self(f"request {desc.request_id}: after the anchor landed, before the residual")
