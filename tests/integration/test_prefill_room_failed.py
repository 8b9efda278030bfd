"""A room SGLang fails on the prefill before its Lynx transfer starts: each decode that holds a region for
it is told ``quiet`` at once (no byte will come), and the room's chunks are refused from then on.

Stand-ins for SGLang's transfer records (unit tier); the real path runs in the 30-minute soak, where
aborts while bootstrapping held an 18 MB decode region for ``transfer_timeout_s`` each and the
requests queued behind it timed out waiting for staging. The decode half (a quiet for a quarantined
region frees it; for an active one, the later failure frees it at once) is tested on the real
allocator here as well.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import numpy as np

from sglang_lynx.integration.transport.prefill_side import MAX_QUIETED_ROOMS, LynxPrefillSide
from sglang_lynx.transfer.staging import StagingAllocator
from sglang_lynx.transfer.streams import StreamKind


class _Control:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, endpoint: str, msg: dict[str, Any]) -> None:
        self.sent.append((endpoint, msg))


def _side() -> LynxPrefillSide:
    side = object.__new__(LynxPrefillSide)
    side._lock = threading.Lock()
    side._endpoints, side._submitting, side._pending, side._quieted = {}, set(), {}, OrderedDict()
    side._streamed, side._unsent = {}, OrderedDict()
    side.control = _Control()  # type: ignore[assignment]
    return side


def _manager(room: int, sessions: dict[str, str | None]) -> SimpleNamespace:
    """``sessions``: decode session -> its Lynx control endpoint (None: registered without Lynx)."""
    infos = {s: SimpleNamespace(is_dummy=False, dst_kv_indices=np.arange(4), lynx={"target": {}}) for s in sessions}
    table = {s: SimpleNamespace(lynx=None if c is None else {"control": c}) for s, c in sessions.items()}
    return SimpleNamespace(transfer_infos={room: infos}, decode_kv_args_table=table, failures={},
                           record_failure=lambda r, why: None)


def test_a_room_failed_before_its_transfer_tells_each_lynx_decode_it_is_quiet_once() -> None:
    side, manager = _side(), _manager(7, {"d1": "tcp://a:1", "d2": "tcp://b:2", "plain": None})
    side.on_room_failed(manager, 7)
    assert sorted(side.control.sent) == [("tcp://a:1", {"type": "quiet", "request_id": "7"}),  # type: ignore[attr-defined]
                                         ("tcp://b:2", {"type": "quiet", "request_id": "7"})]
    side.on_room_failed(manager, 7)  # SGLang updates a failed room's status again: nobody told twice
    assert len(side.control.sent) == 2  # type: ignore[attr-defined]


def test_a_decode_whose_metadata_came_after_the_failure_is_told_then() -> None:
    side, manager = _side(), _manager(7, {})
    side.on_room_failed(manager, 7)  # failed while bootstrapping: no decode had sent its target yet
    assert side.control.sent == []  # type: ignore[attr-defined]
    late = _manager(7, {"d1": "tcp://a:1"})
    side.on_room_failed(late, 7)  # its WaitingForInput comes in after the failure
    assert side.control.sent == [("tcp://a:1", {"type": "quiet", "request_id": "7"})]  # type: ignore[attr-defined]


def test_a_started_transfer_is_left_to_quiet_itself() -> None:
    side, manager = _side(), _manager(7, {"d1": "tcp://a:1"})
    side._endpoints["7"] = "tcp://a:1"  # submitted to the scheduler: it sends quiet after its last write
    side.on_room_failed(manager, 7)
    side._endpoints.clear()
    side._submitting.add(7)  # between its last chunk and the scheduler: the same
    side.on_room_failed(manager, 7)
    assert side.control.sent == [] and 7 not in side._quieted  # type: ignore[attr-defined]


def test_partial_chunks_are_dropped_and_later_chunks_refused() -> None:
    side, manager = _side(), _manager(7, {"d1": "tcp://a:1"})
    side._pending[7] = SimpleNamespace()  # type: ignore[assignment]  # copied chunks, last one not yet in
    side.on_room_failed(manager, 7)
    assert 7 not in side._pending and len(side.control.sent) == 1  # type: ignore[attr-defined]
    # a chunk of that room reaching send_kvcache afterwards (SGLang's worker had queued it): refused,
    # nothing copied or sent, the reason recorded
    refused: dict[int, str] = {}
    manager.record_failure = lambda room, why: refused.__setitem__(room, why)
    info = manager.transfer_infos[7]["d1"]
    info.mooncake_session_id, info.decode_prefix_len = "d1", 0
    info.lynx = {"tokens": 4, "target": {"session_id": "s", "arena_addr": 4096, "arena_bytes": 1 << 20,
                                         "regions": {"anchor": [4096, 1024]}}}
    manager.decode_kv_args_table["d1"].lynx = {"control": "tcp://a:1", "fingerprint": "fp"}
    side.fingerprint, side.page_size = "fp", 1
    side.tp = SimpleNamespace(size=1)  # type: ignore[assignment]
    side.config = SimpleNamespace(transfer_timeout_s=30.0)  # type: ignore[assignment]
    assert side.send_kvcache(manager, "d1", np.arange(2), info.dst_kv_indices[0:2]) == -1
    assert "failed before its Lynx transfer started" in refused[7] and 7 not in side._pending


def test_the_record_of_quieted_rooms_is_bounded() -> None:
    side, manager = _side(), _manager(0, {})
    for room in range(MAX_QUIETED_ROOMS + 10):
        side.on_room_failed(manager, room)
    assert len(side._quieted) == MAX_QUIETED_ROOMS and 0 not in side._quieted


def test_the_decode_frees_a_region_its_sender_called_quiet() -> None:
    clock = [0.0]
    alloc = StagingAllocator(4096, 1 << 20, clock=lambda: clock[0])
    sizes = {StreamKind.ANCHOR: 4096, StreamKind.RESIDUAL: 4096}
    alloc.allocate("7", sizes)
    alloc.quarantine("7", "aborted", hold_s=30.0)
    assert alloc.stats()["quarantined"] == 1
    alloc.sender_quiet("7")  # the prefill's quiet for a room that never started: freed at once
    assert alloc.stats()["leases"] == 0 and alloc.stats()["free_bytes"] == 1 << 20
    alloc.allocate("8", sizes)
    alloc.sender_quiet("8")  # quiet before the decode failed it: the failure frees it at once
    alloc.quarantine("8", "aborted", hold_s=30.0)
    assert alloc.stats()["leases"] == 0


def test_a_room_sglang_still_tracks_is_alive_however_old() -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_lynx.integration.transport.prefill_peers import sglang_tracks

    manager = SimpleNamespace(request_status={1: KVPoll.Transferring, 2: KVPoll.WaitingForInput, 3: KVPoll.Failed})
    assert [sglang_tracks(manager, r) for r in (1, 2, 3, 4)] == [True, True, False, False]
    assert sglang_tracks(SimpleNamespace(), 1) is False  # a manager without statuses tracks nothing


def test_unsent_rooms_are_forgotten_only_when_old_and_untracked() -> None:
    """A chunk computed without layers holds the layered requests back until its send_kvcache comes (FIFO);
    a forward longer than ``transfer_timeout_s`` must not let them overtake it while SGLang still tracks it."""
    from sglang_lynx.integration.transport.prefill_layers import prune_unsent

    unsent = OrderedDict([(1, 0.0), (2, 0.0), (3, 99.0)])
    prune_unsent(unsent, now=100.0, limit=60.0, tracked=lambda room: room == 2)
    assert list(unsent) == [2, 3]  # 1: old and untracked (its send_kvcache will never come); 3: recent
