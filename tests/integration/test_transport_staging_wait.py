"""The decode side's receive arena (real Mooncake engine on loopback, no SGLang server): start-up sizing,
FIFO reservation that holds SGLang's metadata back until the region is reserved, and the clear errors."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_lynx.config import LynxConfig, LynxConfigError
from sglang_lynx.transfer.staging import StagingFullError, StagingTooLargeError

HEADS, DIM = 2, 64  # one layer: ~300 bytes/token in mode lynx, so 1 MiB holds one 2000-token request


def _side(**config: object):  # noqa: ANN202
    from sglang_lynx.integration.transport.decode_side import LynxDecodeSide

    side = LynxDecodeSide(LynxConfig(mode="lynx", **config), "127.0.0.1")  # type: ignore[arg-type]
    return side


def _pool(tokens: int = 8192) -> list[torch.Tensor]:
    return [torch.zeros(tokens, HEADS, DIM)]


@pytest.mark.timeout(120)
def test_decode_reserves_in_fifo_order_and_sends_metadata_only_when_reserved() -> None:
    side = _side(receive_arena_mb=1, transfer_timeout_s=0.5)
    try:
        side.attach_pool(_pool(), _pool(), pool_tokens=8192, max_request_tokens=2048)
        assert side.snapshot()["staging"]["arena_bytes"] == 1 << 20
        assert side.expect(1, range(2000)) is True and side.metadata_field(1) is not None  # reserved at once
        assert side.expect(2, range(2000, 4000)) is False  # no room: waits, no target for the metadata yet
        assert side.metadata_field(2) is None and side.reserve(2) is False
        assert side.snapshot()["staging"]["waiting"] == 1 and side.tracker.get("2") is None
        side.tracker.on_sender_quiet("1")
        side.abort(1, "test: done with it")  # its sender is quiet: the region is free at once
        assert side.reserve(2) is True and side.metadata_field(2) is not None
        assert side.snapshot()["staging"]["waiting"] == 0 and side.tracker.get("2") is not None

        # a request larger than the whole arena fails at once, naming the field, and is not tracked
        with pytest.raises(StagingTooLargeError, match="receive_arena_mb"):
            side.expect(3, range(6000))
        assert 3 not in side.inbound

        # waiting is bounded by transfer_timeout_s
        assert side.expect(4, range(2000)) is False
        time.sleep(0.6)
        with pytest.raises(StagingFullError, match=r"transfer_timeout_s.*receive_arena_mb.*stayed full"):
            side.reserve(4)
        side.abort(4)
        assert side.snapshot()["staging"]["waiting"] == 0 and 4 not in side.inbound
    finally:
        side.close()


@pytest.mark.timeout(120)
def test_a_busy_arena_keeps_a_request_waiting_past_transfer_timeout_and_a_stuck_one_fails_it() -> None:
    """The wait bound is for a stuck arena (no region freed for ``transfer_timeout_s``), not a busy one:
    regions are held through the prefill's forward, so a queue behind cold prefills moves slowly but
    moves (the 30-minute soak failed 22 such requests after its prefill restart with an absolute bound).
    ``STAGING_WAIT_CAP`` x ``transfer_timeout_s`` bounds the wait in all."""
    from sglang_lynx.integration.transport.decode_side import STAGING_WAIT_CAP

    side = _side(receive_arena_mb=1, transfer_timeout_s=0.5)
    try:
        side.attach_pool(_pool(), _pool(), pool_tokens=8192, max_request_tokens=2048)
        for room in (1, 2, 3):  # three ~300 KB requests in flight
            assert side.expect(room, range(room * 1000, room * 1000 + 1000)) is True
        assert side.expect(9, range(5000, 7000)) is False  # ~600 KB: waits
        for room in (1, 2):
            time.sleep(0.35)
            side.tracker.on_sender_quiet(str(room))
            side.abort(room, "test: done")  # a region freed: the arena is busy, not stuck
            if room == 1:
                time.sleep(0.3)  # waited 0.65 s > transfer_timeout_s, but a region was freed 0.3 s ago
                assert side.reserve(9) is False and 9 in side.inbound
        assert side.reserve(9) is True and side.metadata_field(9) is not None

        assert side.expect(10, range(0, 2000)) is False  # 3 and 9 hold the arena
        deadline = time.monotonic() + STAGING_WAIT_CAP * 0.5 + 0.2
        while time.monotonic() < deadline:  # a region freed just now, again and again: still capped
            side.tracker.allocator.last_freed = time.monotonic()
            try:
                assert side.reserve(10) is False
            except StagingFullError as exc:
                assert f"{STAGING_WAIT_CAP} x transfer_timeout_s" in str(exc) and "stayed full" in str(exc)
                break
            time.sleep(0.05)
        else:
            pytest.fail("a request waited past the cap")
        side.abort(10)
    finally:
        side.close()


@pytest.mark.timeout(120)
def test_an_arena_that_cannot_hold_one_max_context_request_refuses_start_up() -> None:
    side = _side(receive_arena_mb=1)
    try:
        with pytest.raises(LynxConfigError, match=r"receive_arena_mb: 1 MiB cannot hold one max-context request "
                                                  r"\(8192 tokens"):
            side.attach_pool(_pool(), _pool(), pool_tokens=8192, max_request_tokens=8192)
    finally:
        side.close()
    side = _side(arena_cap_mb=1)
    try:
        with pytest.raises(LynxConfigError, match=r"receive_arena_mb: \"auto\" is capped at arena_cap_mb=1 MiB"):
            side.attach_pool(_pool(), _pool(), pool_tokens=8192, max_request_tokens=8192)
        side.attach_pool(_pool(), _pool(), pool_tokens=8192, max_request_tokens=2048)  # one request fits
        assert side.snapshot()["staging"]["arena_bytes"] == 1 << 20
    finally:
        side.close()


class _FakeLynx:
    """The decode side as the receiver hook sees it: ``expect`` / ``reserve`` answers scripted."""

    def __init__(self, reserve_answers: list[object]) -> None:
        self.reserve_answers, self.aborted = list(reserve_answers), []  # type: ignore[var-annotated]
        self.refused: list[tuple[int, str]] = []

    def refuse(self, room: int, reason: str) -> None:
        self.refused.append((room, reason))

    def expect(self, room: int, kv_indices: object, source: object, **layout: object) -> bool:
        return False  # no room yet

    def reserve(self, room: int) -> bool:
        answer = self.reserve_answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    def abort(self, room: int, reason: str = "") -> None:
        self.aborted.append(reason)


def _receiver(lynx: _FakeLynx):  # noqa: ANN202
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_lynx.integration.transport.kv_manager import _make_receiver

    failures: list[str] = []
    status: dict[int, object] = {}
    mgr = SimpleNamespace(lynx=lynx, record_failure=lambda room, why: failures.append(why),
                          update_status=lambda room, s: status.__setitem__(room, s))

    class Base:
        def __init__(self) -> None:
            self.kv_mgr, self.bootstrap_room, self.conclude_state, self.sent = mgr, 7, None, []

        def send_metadata(self, kv_indices: object, *args: object, **kwargs: object) -> None:
            self.sent.append((kv_indices, args, kwargs))

        def _poll(self) -> object:
            return status.get(7, KVPoll.WaitingForInput)

        def abort(self) -> None:
            pass

    return _make_receiver(Base)(), failures, KVPoll


def test_the_receiver_holds_sglangs_metadata_back_until_its_staging_is_reserved() -> None:
    receiver, failures, kv_poll = _receiver(_FakeLynx([False, False, True]))
    receiver.send_metadata([1, 2, 3], 5, decode_prefix_len=0)
    assert receiver.sent == []  # the prefill gets nothing (computes nothing) while there is no room
    assert receiver._poll() == kv_poll.WaitingForInput and receiver.sent == []
    assert receiver._poll() == kv_poll.WaitingForInput and receiver.sent == []
    assert receiver._poll() == kv_poll.WaitingForInput
    assert receiver.sent == [([1, 2, 3], (5,), {"decode_prefix_len": 0})]  # sent once, as SGLang asked
    receiver._poll()
    assert len(receiver.sent) == 1 and failures == []


def test_a_receiver_whose_staging_wait_fails_fails_the_request_with_the_reason() -> None:
    lynx = _FakeLynx([False, StagingFullError("waited 61 s (transfer_timeout_s) ... receive_arena_mb ...")])
    receiver, failures, kv_poll = _receiver(lynx)
    receiver.send_metadata([1, 2, 3])
    assert receiver._poll() == kv_poll.WaitingForInput
    assert receiver._poll() == kv_poll.Failed
    assert failures and failures[0].startswith("Lynx staging: waited 61 s") and "receive_arena_mb" in failures[0]
    assert lynx.aborted and lynx.reserve_answers == []
    # the metadata still goes out once, carrying the refusal: the prefill must not wait for it until
    # SGLang's bootstrap timeout (the soak's lost requests: the router waited on the prefill's answer)
    assert receiver.sent == [([1, 2, 3], (), {})]
    assert lynx.refused and lynx.refused[0][0] == 7 and "receive_arena_mb" in lynx.refused[0][1]
    receiver._poll()  # nothing more is asked or sent
    assert len(receiver.sent) == 1


def test_the_decode_sides_refusal_rides_on_the_metadata_and_the_prefill_fails_the_request_with_it() -> None:
    from types import SimpleNamespace

    from sglang_lynx.integration.transport import prefill_side as tp
    from sglang_lynx.integration.transport.kv_manager import _after_transfer_info_from_zmq
    from sglang_lynx.integration.transport.wire import parse_field

    side = _side(receive_arena_mb=1, transfer_timeout_s=0.5)
    try:
        side.refuse(9, "the decode server could not stage it: waited 31 s ... receive_arena_mb")
        frame = side.metadata_field(9)
        assert frame is not None and side.metadata_field(9) is None  # once
    finally:
        side.close()
    info = _after_transfer_info_from_zmq(SimpleNamespace(), None, [b"sglang frame", frame])
    assert info.lynx == parse_field([b"x", frame]) and "receive_arena_mb" in info.lynx["refused"]

    prefill = tp.LynxPrefillSide(LynxConfig(mode="lynx"), "127.0.0.1")
    recorded: list[tuple[int, str]] = []
    info.is_dummy, info.dst_kv_indices = False, [3, 4, 5]
    manager = SimpleNamespace(transfer_infos={9: {"session": info}}, decode_kv_args_table={
        "session": SimpleNamespace(lynx={"fingerprint": prefill.fingerprint})},
        record_failure=lambda room, why: recorded.append((room, why)))
    try:
        assert prefill.send_kvcache(manager, "session", [0, 1, 2], [3, 4, 5]) == -1
    finally:
        prefill.close()
    assert recorded == [(9, "sglang-lynx: the decode server could not stage it: waited 31 s ... receive_arena_mb")]


@pytest.mark.timeout(120)
def test_the_prefill_waits_for_its_send_region_and_refuses_clearly_when_it_cannot_get_one() -> None:
    from types import SimpleNamespace

    from sglang_lynx.integration.transport import prefill_side as tp
    from sglang_lynx.transfer.control import ControlServer
    from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion

    got: list[dict[str, object]] = []
    decode_control = ControlServer("127.0.0.1", got.append)
    side = tp.LynxPrefillSide(LynxConfig(mode="lynx", send_arena_mb=1, transfer_timeout_s=0.5), "127.0.0.1")
    pool = [torch.randn(8192, HEADS, DIM)]
    side.attach_pool(pool, [torch.randn(8192, HEADS, DIM)], pool_tokens=8192, max_request_tokens=2048)
    target = RemoteTarget("127.0.0.1:1", 1 << 32, 1 << 30, {StreamKind.ANCHOR: StreamRegion(1 << 32, 1 << 24),
                                                              StreamKind.RESIDUAL: StreamRegion((1 << 32) + (1 << 24),
                                                                                                1 << 24)})

    def pending(tokens: int) -> tp.Pending:
        slots = torch.arange(tokens)
        return tp.Pending(tokens, tokens, target, decode_control.endpoint, k_parts=[[pool[0][slots]]],
                           v_parts=[[pool[0][slots]]], slots=[slots], pages=tokens)

    recorded: list[tuple[int, str]] = []
    manager = SimpleNamespace(record_failure=lambda room, why: recorded.append((room, why)))
    try:
        t0 = time.monotonic()
        assert side._submit(manager, 1, pending(6000)) == -1  # larger than the whole arena: at once
        assert time.monotonic() - t0 < 5
        assert "send arena too small" in recorded[-1][1] and "send_arena_mb" in recorded[-1][1]
        side.send_alloc.allocate("holder", {StreamKind.ANCHOR: (1 << 20) - 4096})
        t0 = time.monotonic()
        assert side._submit(manager, 2, pending(2000)) == -1  # waited its turn for 0.5 s, then refused
        assert time.monotonic() - t0 >= 0.45
        assert recorded[-1][0] == 2 and "send arena full: waited" in recorded[-1][1], recorded
        assert side.send_alloc.stats()["waiting"] == 0 and side.send_alloc.stats()["waits"] >= 1
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [m["type"] for m in got] == ["quiet", "quiet"]  # the decode may free its regions at once
    finally:
        side.close()
        decode_control.close()
