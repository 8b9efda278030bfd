"""``benchmark.pd_modes.stop_on_sigterm``: a benchmark stopped by SIGTERM (``timeout``) unwinds its ``with`` blocks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from benchmark.pd_modes import stop_on_sigterm
stop_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open({marker!r}, "w").write("torn down")
"""


def test_sigterm_runs_the_finally_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=root, marker=str(marker))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 5
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "torn down"
    assert proc.returncode != 0  # it stopped as interrupted, not as a success
