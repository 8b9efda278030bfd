"""The Lynx frames appended to SGLang's bootstrap messages, and the control channel (real ZMQ on
loopback): malformed peer input is refused with a clear error, never trusted."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.wire import (
    MAGIC,
    LynxWireError,
    config_fingerprint,
    encode_field,
    parse_field,
    validate_registration,
)
from sglang_lynx.transfer.control import ControlClient, ControlMessageError, ControlServer, decode_message

GOOD = {"session": "127.0.0.1:1234", "arena_addr": 4096, "arena_bytes": 1 << 20,
        "control": "tcp://127.0.0.1:5555", "fingerprint": "lynx-int8|..."}


def test_fingerprint_differs_when_bytes_would_mean_something_else() -> None:
    base = LynxConfig(mode="lynx-int8")
    assert config_fingerprint(base) == config_fingerprint(LynxConfig(mode="lynx-int8"))
    assert config_fingerprint(base) != config_fingerprint(LynxConfig(mode="lynx-int8", chunk_tokens=16))
    assert config_fingerprint(base) != config_fingerprint(LynxConfig(mode="int8"))
    assert config_fingerprint(base) != config_fingerprint(LynxConfig(mode="lynx-int8", value_group_size=32))
    assert config_fingerprint(base) != config_fingerprint(LynxConfig(mode="lynx-int8", key_chunk_tokens=32))
    # knobs that do not change the bytes do not change the fingerprint
    assert config_fingerprint(base) == config_fingerprint(LynxConfig(mode="lynx-int8", residual_window=7))


def test_frame_round_trip_and_absence() -> None:
    msg = [b"room", b"127.0.0.1", encode_field(GOOD)]
    assert parse_field(msg) == GOOD
    assert parse_field([b"room", b"127.0.0.1"]) is None
    assert parse_field([]) is None


@pytest.mark.parametrize("raw", [MAGIC + b"{not json", MAGIC + b"[1, 2]", MAGIC + b"x" * (17 << 10)])
def test_malformed_frames_are_refused(raw: bytes) -> None:
    with pytest.raises(LynxWireError):
        parse_field([b"a", raw])


@pytest.mark.parametrize(("field", "value"), [
    ("arena_addr", 0), ("arena_addr", -5), ("arena_bytes", 1 << 50), ("arena_addr", "4096"),
    ("control", "ipc:///tmp/x"), ("session", 7), ("fingerprint", None), ("arena_bytes", True),
])
def test_registration_with_bad_field_is_refused(field: str, value: object) -> None:
    with pytest.raises(LynxWireError, match=field):
        validate_registration({**GOOD, field: value})


def test_control_message_checks() -> None:
    assert decode_message(b'{"type": "quiet", "request_id": "7"}')["type"] == "quiet"
    for raw in (b"{}", b'{"type": "landed"}', b"\xff\xfe", b'{"type": "boom", "request_id": 1}', b"x" * (65 << 10)):
        with pytest.raises(ControlMessageError):
            decode_message(raw)


@pytest.mark.timeout(60)
def test_control_channel_delivers_and_survives_garbage() -> None:
    got: list[dict] = []
    arrived = threading.Event()

    def on_message(msg: dict) -> None:
        got.append(msg)
        if len(got) == 2:
            arrived.set()

    server = ControlServer("127.0.0.1", on_message)
    client = ControlClient()
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        import zmq

        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.endpoint)
        raw.send(b"garbage")  # dropped and counted, the thread keeps going
        assert client.send(server.endpoint, {"type": "quiet", "request_id": "1"})
        assert client.send(server.endpoint, {"type": "failed", "request_id": "2", "stream": "anchor",
                                             "reason": "test"})
        assert arrived.wait(20), got
        deadline = time.monotonic() + 5
        while server.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.dropped == 1
        assert [m["type"] for m in got] == ["quiet", "failed"]
        raw.close(0)
    finally:
        client.close()
        server.close()


def test_transfer_deadline_starts_when_armed_not_when_expected() -> None:
    """A request queued behind others at the prefill must not time out: the transfer clock starts
    when SGLang reports the prefill done (``LynxDecodeSide.arm`` -> ``tighten_deadline``)."""
    from sglang_lynx.transfer.receiver import ReceiveTracker
    from sglang_lynx.transfer.staging import StagingAllocator
    from sglang_lynx.transfer.streams import StreamKind

    now = [0.0]
    tracker = ReceiveTracker(StagingAllocator(4096, 1 << 20, clock=lambda: now[0]), clock=lambda: now[0])
    tracker.expect("r", {StreamKind.ANCHOR: 100}, timeout_s=24 * 3600.0)
    now[0] = 500.0  # a long prefill queue
    assert tracker.expire() == []
    tracker.tighten_deadline("r", 30.0)
    tracker.tighten_deadline("r", 1000.0)  # never loosens
    now[0] = 529.0
    assert tracker.expire() == []
    now[0] = 531.0
    assert tracker.expire() == ["r"]


def test_link_emulation_env_takes_a_rate_or_a_rate_file(monkeypatch, tmp_path) -> None:
    from sglang_lynx.integration.transport.prefill_side import LINK_ENV, pacer_from_env

    monkeypatch.delenv(LINK_ENV, raising=False)
    assert pacer_from_env() is None
    monkeypatch.setenv(LINK_ENV, "2.5")
    pacer = pacer_from_env()
    assert pacer is not None and pacer.gbps == pytest.approx(2.5) and pacer.rate_file is None
    rate = tmp_path / "gbps"
    rate.write_text("0.3")
    monkeypatch.setenv(LINK_ENV, f"@{rate}")
    pacer = pacer_from_env()
    assert pacer is not None and pacer.gbps == pytest.approx(0.3) and pacer.rate_file == str(rate)
    for bad in ("fast", "0", f"@{tmp_path / 'missing'}"):
        monkeypatch.setenv(LINK_ENV, bad)
        with pytest.raises(ValueError, match="rate"):
            pacer_from_env()
