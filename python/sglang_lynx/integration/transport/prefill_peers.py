"""Which request a prefill chunk belongs to, which decodes were given a target for it, whether SGLang still
tracks a request, and how a chunk is refused: the prefill side's reads of SGLang's KV manager
(``transfer_infos``, ``decode_kv_args_table``, ``request_status``, ``record_failure``, ``lynx_refused_rooms``).
Functions only, no state of their own.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

logger = logging.getLogger("sglang_lynx.transport")

MAX_REFUSED_ROOMS = 4096


def sglang_tracks(manager: Any, room: int) -> bool:
    """SGLang's KV manager still tracks ``room`` with a status other than ``Failed``: a request alive on
    this prefill (its own timeouts govern it; a failed one reaches ``on_room_failed``), however long its
    chunks take."""
    status = (getattr(manager, "request_status", None) or {}).get(room)
    if status is None:
        return False
    from sglang.srt.disaggregation.base.conn import KVPoll

    return bool(status != KVPoll.Failed)


def _same_buffer(chunk: Any, whole: Any) -> bool:
    """Whether ``chunk`` is a view into ``whole`` (numpy arrays; anything else: no)."""
    return isinstance(chunk, np.ndarray) and isinstance(whole, np.ndarray) and bool(np.may_share_memory(chunk, whole))


def find_chunk_owner(manager: Any, session_id: str, dst_kv_indices: Any) -> tuple[int, Any, dict | None] | None:
    """The room (with its transfer info and the decode's Lynx registration) a chunk belongs to.

    SGLang's transfer worker passes a slice of the room's own
    ``dst_kv_indices`` array, so the room is the one whose array the chunk views. Matching by value
    alone is wrong when the decode reused slots: a room the prefill still holds (aborted, failed, not
    yet cleaned up) may list the same first slot, and taking it cut the live request's KV short
    ("sent 986 pages, decode allocated 675" in the soak). Without a shared buffer (a copy), the
    latest registered room holding the first slot wins.
    """
    if len(dst_kv_indices) == 0:
        return None
    first = int(dst_kv_indices[0])
    owner = None
    for room, infos in list(manager.transfer_infos.items()):
        info = infos.get(session_id)
        if info is None or info.is_dummy:
            continue
        if _same_buffer(dst_kv_indices, info.dst_kv_indices):
            owner = (room, info)
            break
        if first in info.dst_kv_indices:
            owner = (room, info)  # dict order: a later registration replaces an earlier one
    if owner is None:
        return None
    registration = manager.decode_kv_args_table.get(session_id)
    return owner[0], owner[1], getattr(registration, "lynx", None)


def decode_endpoints(manager: Any, room: int) -> list[str]:
    """The control endpoints of the Lynx decodes that were given a target for ``room``."""
    endpoints = []
    for session_id, info in list(getattr(manager, "transfer_infos", {}).get(room, {}).items()):
        lynx = getattr(info, "lynx", None)
        if getattr(info, "is_dummy", False) or not isinstance(lynx, dict) or "target" not in lynx:
            continue
        registration = getattr(manager, "decode_kv_args_table", {}).get(session_id)
        control = (getattr(registration, "lynx", None) or {}).get("control")
        if isinstance(control, str):
            endpoints.append(control)
    return endpoints


def tp_mismatch_reason(prefill_tp: int, decode_tp: int) -> str:
    return (f"tensor parallel sizes differ: prefill --tp-size {prefill_tp}, decode --tp-size {decode_tp}; Lynx "
            "streams each rank's own KV heads to the decode rank of the same index, so both servers need the "
            "same --tp-size")


def refuse(manager: Any, room: int, reason: str) -> int:
    """Fail the request's chunk (-1) with ``reason`` as SGLang's root cause: SGLang keeps the first
    recorded failure of a room and sends it to the decode side, which puts it in the client's error."""
    logger.error("lynx: request %s: %s", room, reason)
    refused = getattr(manager, "lynx_refused_rooms", None)
    if refused is not None:  # not a dead session: the manager forgives it (kv_classes.conclude_failure)
        if len(refused) >= MAX_REFUSED_ROOMS:  # conclude_failure pops each; a bound all the same
            refused.pop(next(iter(refused)))
        refused[room] = reason
    record = getattr(manager, "record_failure", None)
    if record is not None:
        record(room, f"sglang-lynx: {reason}")
    return -1
