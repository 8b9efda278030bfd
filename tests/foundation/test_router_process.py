"""The router entry our launcher uses (``integration.platform.router_process``) parses exactly as
``sglang_router.launch_router`` does, refuses the Python mini balancer, and starts fast (it does not
import ``sglang``). A real router started through it serves every PD deployment of the server tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_lynx.launch.deployment import ROUTER_ENTRY, PDDeployment


def _router_flags(tmp_path: Path, prefills: int = 2, decodes: int = 1) -> list[str]:
    pd = PDDeployment("/m", log_dir=tmp_path, prefills=prefills, decodes=decodes, router_port=30001,
                      metrics_port=30002, router_args=["--policy", "round_robin"])
    pd.server_processes()
    argv = pd.router_argv()
    assert argv[1:3] == ["-m", ROUTER_ENTRY]
    return argv[3:]


def test_it_parses_the_launchers_flags_as_sglang_router_does(tmp_path: Path) -> None:
    from sglang_router.launch_router import parse_router_args

    from sglang_lynx.integration.platform.router_process import parse

    flags = _router_flags(tmp_path)
    ours, stock = parse(flags), parse_router_args(flags)
    assert ours == stock
    assert ours.pd_disaggregation and len(ours.prefill_urls) == 2 and len(ours.decode_urls) == 1
    assert ours.port == 30001 and ours.prometheus_port == 30002 and ours.policy == "round_robin"


def test_the_mini_balancer_is_refused_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_lynx.integration.platform.router_process import parse

    with pytest.raises(SystemExit):
        parse([*_router_flags(tmp_path), "--mini-lb"])
    assert "--mini-lb" in capsys.readouterr().err


def test_the_entry_does_not_import_sglang() -> None:
    flags = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "2", "--decode", "http://127.0.0.1:3"]
    code = ("import sys, sglang_lynx.integration.platform.router_process as m; "
            f"m.parse({flags!r}); import sglang_router.router; "
            "print(sorted(n for n in sys.modules if n == 'sglang' or n.startswith('sglang.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_sigint_stops_a_real_router_cleanly(tmp_path: Path) -> None:
    """A real router started through the entry answers /health, and SIGINT (the launcher's first stop signal)
    ends it with status 0 and no traceback in its log."""
    import signal
    import time

    from sglang_lynx.launch.processes import free_port, http_ok

    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", ROUTER_ENTRY, "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{free_port()}",
            "--decode", f"http://127.0.0.1:{free_port()}", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    log = tmp_path / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not http_ok(f"http://127.0.0.1:{port}/health", timeout=2) and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.2)
            assert http_ok(f"http://127.0.0.1:{port}/health", timeout=2), log.read_text()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "router: stopped (SIGINT)" in text
