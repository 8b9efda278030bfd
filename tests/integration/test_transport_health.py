"""The transport sides report their health in ``/get_server_info`` (real Mooncake engine and control
plane on loopback): a control or scheduler thread that stopped shows as ``unhealthy_reason`` in the
``lynx`` block of the internal state, and a prefill whose scheduler is unhealthy refuses a request
with the reason instead of queueing it into a dead thread."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.kv_manager import _after_internal_state

MIB = 1 << 20


class Killer(BaseException):
    """Escapes the threads' ``except Exception``: the thread ends."""


def _server_info(scheduler: Any) -> dict[str, Any]:
    result = SimpleNamespace(internal_state={})
    _after_internal_state(result, SimpleNamespace(scheduler=scheduler))
    return result.internal_state["lynx"]  # type: ignore[no-any-return]


def _wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_a_stopped_control_thread_shows_in_the_decode_server_info() -> None:
    import torch

    from sglang_lynx.integration.transport.decode_side import LynxDecodeSide
    from sglang_lynx.transfer.control import ControlClient

    side = LynxDecodeSide(LynxConfig(mode="lynx", receive_arena_mb=4), "127.0.0.1")
    side.attach_pool([torch.zeros(64, 2, 64)], [torch.zeros(64, 2, 64)], pool_tokens=64, max_request_tokens=64)
    client = ControlClient()
    allocator = SimpleNamespace(available_size=lambda: 7)
    scheduler = SimpleNamespace(disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=SimpleNamespace(lynx=side)),
                                token_to_kv_pool_allocator=allocator)
    try:
        info = _server_info(scheduler)
        assert info["unhealthy_reason"] is None and info["internal_errors"] == 0
        assert client.send(side.control.endpoint, {"type": "quiet", "request_id": "never-seen"})

        def dies(msg: dict[str, Any]) -> None:
            raise Killer("control thread killed")

        side.control.on_message = dies
        assert client.send(side.control.endpoint, {"type": "quiet", "request_id": "1"})
        _wait(lambda: side.unhealthy_reason() is not None)
        info = _server_info(scheduler)
        assert "lynx-control thread stopped" in info["unhealthy_reason"] and "control thread killed" in info[
            "unhealthy_reason"]
    finally:
        client.close()
        side.close()


@pytest.mark.timeout(120)
def test_an_unhealthy_prefill_scheduler_refuses_with_the_reason_and_reports_it(monkeypatch) -> None:  # noqa: ANN001
    import torch

    from sglang_lynx.integration.transport import prefill_side as tp
    from sglang_lynx.transfer import scheduler as scheduler_module
    from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion

    side = tp.LynxPrefillSide(LynxConfig(mode="lynx", send_arena_mb=4), "127.0.0.1")
    scheduler = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=SimpleNamespace(lynx=side)),
                                token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 7))
    tokens, heads, dim = 32, 2, 64
    side.attach_pool([torch.randn(tokens, heads, dim)], [torch.randn(tokens, heads, dim)], pool_tokens=tokens,
                     max_request_tokens=tokens)
    target = RemoteTarget("127.0.0.1:1", 1 << 32, 1 << 20, {StreamKind.ANCHOR: StreamRegion(1 << 32, 1 << 19),
                                                              StreamKind.RESIDUAL: StreamRegion((1 << 32) + (1 << 19),
                                                                                                1 << 19)})

    def pending() -> tp.Pending:
        slots = torch.arange(tokens)
        return tp.Pending(tokens, tokens, target, "tcp://127.0.0.1:1", k_parts=[[side.k_pool[0][slots]]],
                           v_parts=[[side.v_pool[0][slots]]], slots=[slots], pages=tokens)

    def dies(addr: int, n: int) -> int:
        raise Killer("crc thread killed")

    recorded: list[tuple[int, str]] = []
    manager = SimpleNamespace(record_failure=lambda room, why: recorded.append((room, why)))
    try:
        assert _server_info(scheduler)["unhealthy_reason"] is None
        monkeypatch.setattr(scheduler_module, "checksum_at", dies)
        assert side._submit(manager, 1, pending()) == 0  # accepted; its checksum kills the crc thread
        _wait(lambda: side.unhealthy_reason() is not None)
        info = _server_info(scheduler)
        assert "lynx-crc thread stopped" in info["unhealthy_reason"] and info["internal_errors"] >= 1
        assert side._submit(manager, 2, pending()) == -1  # refused at once, with the reason
        assert recorded and recorded[-1][0] == 2 and "lynx-crc thread stopped" in recorded[-1][1]
        assert "2" not in side._endpoints and side.send_alloc.lease("2") is None  # its send region is free
    finally:
        side.close()
