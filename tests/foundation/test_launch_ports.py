"""The launcher's port picks and health probe (no servers)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

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


def test_an_xpyd_deployment_gives_every_server_its_ports_and_the_router_every_server(tmp_path: Path) -> None:
    from sglang_lynx.launch.deployment import PDDeployment

    pd = PDDeployment("/m", extra_args=["--lynx"], log_dir=tmp_path, prefills=2, decodes=3)
    procs = pd.server_processes()
    assert [p.name for p in procs] == ["prefill0", "prefill1", "decode0", "decode1", "decode2"]
    ports = pd.prefill_ports + pd.bootstrap_ports + pd.decode_ports
    assert len(ports) == 7 and len(set(ports)) == 7
    for proc, port, bootstrap in zip(procs, pd.prefill_ports, pd.bootstrap_ports, strict=False):
        argv = proc.argv
        assert argv[argv.index("--port") + 1] == str(port) and "--lynx" in argv
        assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == str(bootstrap)
    router = pd.router_argv()
    pairs = [(router[i + 1], router[i + 2]) for i, a in enumerate(router) if a == "--prefill"]
    assert pairs == [(u, str(b)) for u, b in zip(pd.prefill_urls, pd.bootstrap_ports, strict=True)]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--decode"] == pd.decode_urls
    assert pd.server_processes() and pd.prefill_ports + pd.bootstrap_ports + pd.decode_ports == ports  # kept


def test_the_default_deployment_is_still_one_prefill_and_one_decode(tmp_path: Path) -> None:
    import pytest

    from sglang_lynx.launch.deployment import PDDeployment

    pd = PDDeployment("/m", log_dir=tmp_path)
    assert [p.name for p in pd.server_processes()] == ["prefill", "decode"]
    assert pd.router_argv().count("--prefill") == 1 and pd.router_argv().count("--decode") == 1
    with pytest.raises(ValueError, match="prefills must be an int >= 1"):
        PDDeployment("/m", prefills=0)
