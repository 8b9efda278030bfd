"""The plugin on stock SGLang: --lynx in launch_server --help, and clear errors for bad values."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

# One interpreter runs every case: importing SGLang costs ~20 s on this machine.
_PROBE = r"""
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
for extra in CASES:
    try:
        args = prepare_server_args(["--model-path", "/nonexistent"] + extra)
        print("OK", extra)
    except SystemExit as exc:
        print("EXIT", extra, "|", exc.code)
"""


def _run_cases(cases: list[list[str]]) -> list[str]:
    code = f"CASES = {cases!r}\n" + _PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith(("OK", "EXIT"))]


def test_help_lists_lynx_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--lynx-config" in proc.stdout and "--lynx " in proc.stdout


def test_bad_configs_fail_with_the_field_named_and_modes_not_built_refuse_to_start() -> None:
    cases = [
        [],
        ["--lynx", "--lynx-config", '{"mode": "int3"}'],
        ["--lynx", "--lynx-config", '{"chunk_tokens": 48}'],
        ["--lynx", "--lynx-config", '{"max_draft_tokens": -4}'],
        ["--lynx-config", "lynx"],
        ["--lynx", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"],
        ["--lynx", "--lynx-config", "lynx-int8"],
        ["--lynx", "--lynx-config", "lynx-int8", "--disaggregation-mode", "prefill"],
        ["--lynx", "--lynx-config", "int4", "--disaggregation-mode", "decode", "--tp-size", "4"],
        ["--lynx", "--lynx-config", "lynx-exact", "--disaggregation-mode", "decode", "--dtype", "float16"],
        ["--lynx", "--lynx-config", "int4", "--disaggregation-mode", "decode", "--page-size", "16"],
        ["--lynx", "--lynx-config", "lynx-exact", "--disaggregation-mode", "decode", "--dtype", "bfloat16"],
    ]
    lines = _run_cases(cases)
    assert len(lines) == len(cases), lines
    assert lines[0].startswith("OK")  # no --lynx: SGLang as usual
    assert "mode: 'int3' is not a Lynx mode" in lines[1]
    assert "chunk_tokens" in lines[2] and "power of two" in lines[2]
    assert "max_draft_tokens" in lines[3]
    assert "--lynx-config was given without --lynx" in lines[4]
    assert "--disaggregation-transfer-backend" in lines[5]
    assert "--lynx needs --disaggregation-mode prefill or decode" in lines[6]
    assert lines[7].startswith("OK")  # a built mode on a PD server starts
    assert "--tp-size 4" in lines[8]
    assert "--dtype float16" in lines[9] and "bf16 KV pool" in lines[9]  # lynx-exact restores BF16 bit patterns
    assert lines[10].startswith("OK")  # paged KV is supported
    assert lines[11].startswith("OK")  # lynx-exact on a BF16 pool
    assert all(line.startswith("EXIT") for i, line in enumerate(lines) if i not in (0, 7, 10, 11))
