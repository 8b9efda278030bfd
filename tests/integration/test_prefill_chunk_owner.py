"""The prefill side finds the room a chunk belongs to, and a Lynx refusal does not blacklist the session.

Stand-ins for SGLang's transfer records (unit tier); the real paths run in the fault matrix (two
refused requests in a row to one decode server) and the soak (slots reused while aborted rooms linger).

1. SGLang's transfer worker passes ``req.dst_kv_indices[index_slice]``: a view of the room's own array.
   A room the prefill still holds (aborted, failed) may list the same decode slots as a live one once
   the decode reused them; matching by the first slot's value took the stale room and cut the live
   request short ("sent 986 pages, decode allocated 675" in the 30-minute soak).
2. SGLang's worker blacklists a decode session on any failed ``send_kvcache``; a Lynx refusal of one
   request is not a dead session, so the Lynx manager's ``conclude_failure`` forgives it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

from sglang_lynx.integration.transport.kv_manager import _make_manager
from sglang_lynx.integration.transport.prefill_peers import refuse
from sglang_lynx.integration.transport.prefill_side import find_chunk_owner


def _info(slots: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(mooncake_session_id="decode-1", is_dummy=False, dst_kv_indices=slots)


def _manager(*rooms: tuple[int, np.ndarray]) -> SimpleNamespace:
    registration = SimpleNamespace(lynx={"fingerprint": "fp"})
    return SimpleNamespace(transfer_infos={room: {"decode-1": _info(slots)} for room, slots in rooms},
                           decode_kv_args_table={"decode-1": registration})


def test_a_chunk_belongs_to_the_room_whose_array_it_views_even_behind_a_stale_room() -> None:
    stale = np.arange(100, 120)  # an aborted request's slots, since freed and reused by the decode
    live = np.concatenate([np.arange(100, 110), np.arange(300, 320)])
    manager = _manager((1, stale), (2, live))
    chunk = manager.transfer_infos[2]["decode-1"].dst_kv_indices[0:8]
    found = find_chunk_owner(manager, "decode-1", chunk)
    assert found is not None and found[0] == 2
    # order does not matter: the live room registered first, the stale one later
    manager = _manager((2, live), (1, stale))
    chunk = manager.transfer_infos[2]["decode-1"].dst_kv_indices[8:16]
    found = find_chunk_owner(manager, "decode-1", chunk)
    assert found is not None and found[0] == 2 and found[2] == {"fingerprint": "fp"}


def test_a_copied_chunk_falls_back_to_the_latest_room_holding_its_first_slot() -> None:
    manager = _manager((1, np.arange(100, 120)), (2, np.arange(100, 130)), (3, np.arange(500, 510)))
    found = find_chunk_owner(manager, "decode-1", np.arange(100, 104))
    assert found is not None and found[0] == 2
    assert find_chunk_owner(manager, "decode-1", np.arange(900, 904)) is None
    assert find_chunk_owner(manager, "decode-1", np.arange(0)) is None
    assert find_chunk_owner(manager, "decode-other", np.arange(100, 104)) is None


class _SGLangManager:
    """What the Lynx manager's ``conclude_failure`` reads of SGLang's Mooncake manager (0.5.23)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.session_lock = threading.Lock()
        self.session_failures: dict[str, int] = {}
        self.failed_sessions: set[str] = set()
        self.transfer_infos: dict[int, dict[str, Any]] = {}
        self.concluded: list[tuple[int, str]] = []
        self.failures: dict[int, str] = {}

    def _unblacklist_session(self, session_id: str) -> None:
        self.failed_sessions.discard(session_id)
        self.session_failures.pop(session_id, None)

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str, targets: Any = None) -> None:
        self.concluded.append((bootstrap_room, failure_reason))

    def record_failure(self, room: int, reason: str) -> None:
        self.failures.setdefault(room, reason)

    def worker_failed_send(self, room: int, session_id: str) -> None:
        """SGLang's transfer worker after ``send_kvcache`` returned -1 (mooncake/conn.py)."""
        with self.session_lock:
            self.session_failures[session_id] = self.session_failures.get(session_id, 0) + 1
            self.failed_sessions.add(session_id)
        self.conclude_failure(bootstrap_room=room, failure_reason=f"Failed to send kv chunk of {room}")


def _lynx_manager() -> Any:
    manager = object.__new__(_make_manager(_SGLangManager))
    _SGLangManager.__init__(manager)
    manager.lynx_refused_rooms = {}
    return manager


def test_a_lynx_refusal_fails_the_room_but_not_the_session() -> None:
    manager = _lynx_manager()
    manager.transfer_infos[7] = {"decode-1": _info(np.arange(4))}
    assert refuse(manager, 7, "Lynx configuration mismatch") == -1
    manager.worker_failed_send(7, "decode-1")
    assert manager.concluded == [(7, "Failed to send kv chunk of 7")]
    assert manager.failures == {7: "sglang-lynx: Lynx configuration mismatch"}  # the root cause the client sees
    assert "decode-1" not in manager.failed_sessions and manager.lynx_refused_rooms == {}


def test_a_real_send_failure_still_blacklists_the_session() -> None:
    manager = _lynx_manager()
    manager.transfer_infos[8] = {"decode-1": _info(np.arange(4))}
    manager.worker_failed_send(8, "decode-1")  # not refused by Lynx: a failed Mooncake write
    assert "decode-1" in manager.failed_sessions
    # a refusal on a session that had failed before leaves it blacklisted (one failure forgiven, not all)
    manager.transfer_infos[9] = {"decode-1": _info(np.arange(4, 8))}
    refuse(manager, 9, "no staging")
    manager.worker_failed_send(9, "decode-1")
    assert "decode-1" in manager.failed_sessions and manager.session_failures["decode-1"] == 1
