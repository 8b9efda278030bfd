"""A real ``sglang.launch_server`` with an unsupported flag exits at start-up, before the model loads.

Stock launcher, default model, mode ``lynx`` on a decode server with ``--tp-size 4``: the process
must exit non-zero with the refusal (naming ``--tp-size``) on stderr, and SGLang must never have
reached weight loading (its model runner logs "Load weight begin" first) or started a scheduler.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(400)]

#: Importing SGLang takes ~20 s on an idle 2-core host; allow for a loaded one.
EXIT_WITHIN_S = 300


def test_tp_size_4_is_refused_before_the_model_loads(model_path: str, tmp_path) -> None:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--lynx", "--lynx-config", "lynx", "--disaggregation-mode", "decode",
               "--disaggregation-transfer-backend", "mooncake_tcp", "--disable-overlap-schedule",
               "--tp-size", "4"]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=EXIT_WITHIN_S, cwd=tmp_path)
    took = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "sglang-lynx: --tp-size 4" in proc.stderr, output[-3000:]
    assert "start the server with --tp-size 2 or 1" in proc.stderr
    for later in ("Load weight", "Scheduler", "Traceback"):
        assert later not in output, f"{later!r} in the output: refused too late\n{output[-3000:]}"
    print(f"refused in {took:.1f} s")


def test_a_receive_arena_smaller_than_one_max_context_request_refuses_start_up(model_path: str, tmp_path) -> None:
    """Checked when the KV pool exists (the model is loaded by then): the server exits with the field named."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--lynx", "--lynx-config", '{"mode": "lynx", "receive_arena_mb": 1}', "--disaggregation-mode",
               "decode", "--disaggregation-transfer-backend", "mooncake_tcp", "--disable-overlap-schedule",
               "--max-total-tokens", "4096", "--context-length", "2048"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=EXIT_WITHIN_S, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "receive_arena_mb: 1 MiB cannot hold one max-context request" in output, output[-3000:]
    assert "set it to at least 24" in output, output[-3000:]  # 2,047 tokens at ~8.5 bits/value
