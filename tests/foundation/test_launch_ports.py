"""The launcher's port picks and health probe (no servers)."""

from __future__ import annotations

import socket
import threading

from sglang_lynx.launch.processes import LAUNCH_PORT_RANGE, free_port, http_ok


def test_free_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert LAUNCH_PORT_RANGE[0] <= port < LAUNCH_PORT_RANGE[1]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_health_probe_of_a_port_that_speaks_no_http_is_false_not_an_exception() -> None:
    """Seen in a real run: the probed port had been taken by a non-HTTP socket (BadStatusLine)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def answer_garbage() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"\xff\x00\x00\x00\x01garbage\r\n\r\n")

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        assert http_ok(f"http://127.0.0.1:{port}/health", timeout=5.0) is False
    finally:
        thread.join(timeout=5.0)
        server.close()
