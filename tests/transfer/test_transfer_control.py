"""The control plane under failure (real ZMQ on loopback): a dead decode peer among live ones does not
delay the live peers' notices, sockets are bounded (LRU cap, release of a peer that stays down), and
the server's thread survives a handler or socket error and reports a thread that stopped."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from sglang_lynx.transfer.control import ControlClient, ControlServer


def _dead_endpoint() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


class Inbox:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, msg: dict[str, Any]) -> None:
        with self.lock:
            self.got.append(msg)

    def wait_for(self, n: int, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.got) >= n:
                    return list(self.got)
            time.sleep(0.01)
        with self.lock:
            return list(self.got)


def _quiet(i: int) -> dict[str, Any]:
    return {"type": "quiet", "request_id": str(i)}


@pytest.mark.timeout(60)
def test_a_dead_peer_among_live_ones_costs_one_timeout_and_never_delays_them() -> None:
    inboxes = [Inbox(), Inbox()]
    servers = [ControlServer("127.0.0.1", box) for box in inboxes]
    dead = _dead_endpoint()
    client = ControlClient(send_timeout_ms=300, send_hwm=1)
    try:
        t0 = time.monotonic()
        results = []
        for i in range(20):  # one sender thread, notices interleaved as the scheduler's events are
            results.append(client.send(dead, _quiet(i)))
            for server in servers:
                assert client.send(server.endpoint, _quiet(i))
        elapsed = time.monotonic() - t0
        # the dead peer's queue (hwm 1) fills, one send waits out the 300 ms timeout, the rest fail at once
        assert not all(results) and client.failed_sends >= 1
        assert elapsed < 0.3 * 3, f"{elapsed:.2f} s: a dead peer delayed every send"
        for box in inboxes:
            assert [m["request_id"] for m in box.wait_for(20, 10)] == [str(i) for i in range(20)]
    finally:
        client.close()
        for server in servers:
            server.close()


@pytest.mark.timeout(60)
def test_a_send_blocked_on_a_dead_peer_does_not_hold_up_another_thread() -> None:
    box = Inbox()
    server = ControlServer("127.0.0.1", box)
    dead = _dead_endpoint()
    client = ControlClient(send_timeout_ms=1500, send_hwm=1)
    stuck = threading.Event()

    def to_dead() -> None:
        for i in range(2):  # hwm 1: the first message is queued, the second waits its full timeout
            if i == 1:
                stuck.set()
            client.send(dead, _quiet(i))

    worker = threading.Thread(target=to_dead)
    try:
        worker.start()
        assert stuck.wait(5)
        time.sleep(0.1)  # the worker is inside its 1.5 s send now
        t0 = time.monotonic()
        for i in range(5):
            assert client.send(server.endpoint, _quiet(i))
        assert box.wait_for(5, 5) and time.monotonic() - t0 < 1.0  # not behind the 1.5 s send to the dead peer
    finally:
        worker.join(10)
        client.close()
        server.close()


@pytest.mark.timeout(60)
def test_client_sockets_are_bounded_and_a_peer_that_stays_down_is_released() -> None:
    boxes = [Inbox() for _ in range(3)]
    servers = [ControlServer("127.0.0.1", box) for box in boxes]
    client = ControlClient(send_timeout_ms=100, max_peers=2, send_hwm=1, release_after_s=0.2, evict_idle_s=0.3)
    try:
        for server in servers:
            assert client.send(server.endpoint, _quiet(1))
        assert client.peers() == 3  # over the cap while every peer is busy (evicting could reorder notices)
        time.sleep(0.4)
        assert client.send(servers[1].endpoint, _quiet(2))
        assert client.peers() == 2  # the least recently used idle socket (servers[0]) was closed
        assert servers[0].endpoint not in client._peers
        assert client.send(servers[0].endpoint, _quiet(2))  # reconnects on demand, in order
        assert [m["request_id"] for m in boxes[0].wait_for(2, 10)] == ["1", "2"]
        time.sleep(0.4)
        dead = _dead_endpoint()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            client.send(dead, _quiet(0))
            if dead not in client._peers:
                break
            time.sleep(0.02)
        assert dead not in client._peers and client.peers() <= 2
        client.release(servers[0].endpoint)
        assert servers[0].endpoint not in client._peers
    finally:
        client.close()
        for server in servers:
            server.close()
    assert client.peers() == 0


@pytest.mark.timeout(60)
def test_the_server_thread_survives_errors_and_reports_when_it_stops() -> None:
    box = Inbox()
    calls = []

    def handler(msg: dict[str, Any]) -> None:
        calls.append(msg)
        if msg["request_id"] == "boom":
            raise RuntimeError("handler bug")
        box(msg)

    server = ControlServer("127.0.0.1", handler)
    client = ControlClient()
    try:
        assert client.send(server.endpoint, _quiet("boom"))  # type: ignore[arg-type]
        assert client.send(server.endpoint, _quiet(1))
        assert [m["request_id"] for m in box.wait_for(1, 10)] == ["1"]
        assert server.health.errors == 1 and server.unhealthy_reason() is None

        class Killer(BaseException):
            pass

        def dies(msg: dict[str, Any]) -> None:
            raise Killer("control thread killed")

        server.on_message = dies
        assert client.send(server.endpoint, _quiet(2))
        deadline = time.monotonic() + 10
        while server.unhealthy_reason() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "lynx-control thread stopped" in str(server.unhealthy_reason())
    finally:
        client.close()
        server.close()
