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
    from sglang_lynx.integration.transport_decode import LynxDecodeSide

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
