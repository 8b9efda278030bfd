"""Provenance of a benchmark result: the machine, the git commit and the command that produced it.

Every results file a benchmark writes carries ``provenance()`` under the key ``"provenance"``, so the
report (``python -m benchmark.report``) can stamp each table and figure with where it came from and
a reader can reproduce it. Pure apart from reading ``/proc`` and asking git; every reader tolerates
a missing source (the field then says ``unknown``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_RECORDED = ("OMP_NUM_THREADS", "SGLANG_LYNX_LINK_GBPS", "SGLANG_LYNX_PLATFORM")


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def mem_total_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu() -> str:
    if not Path("/dev/nvidiactl").exists():
        return "none"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True)
        return "; ".join(out.stdout.strip().splitlines()) or "nvidia (unnamed)"
    except (OSError, subprocess.SubprocessError):
        return "nvidia (nvidia-smi failed)"


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "platform": platform.platform(),
        "arch": platform.machine(),
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "mem_gib": mem_total_gib(),
        "gpu": _gpu(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in load],
    }


def git_commit(root: Path = REPO_ROOT) -> str:
    """Short hash of HEAD, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def dirty_files(root: Path = REPO_ROOT, limit: int = 60) -> list[str]:
    """Tracked files that differ from HEAD (uncommitted work the run may have used); results files,
    figures and markdown are left out: they are outputs, not code the run executed."""
    try:
        out = subprocess.run(["git", "-C", str(root), "diff", "--name-only", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [f for f in out.split() if not is_output_file(f)][:limit]


def is_output_file(path: str) -> bool:
    return "/results/" in path or path.endswith((".md", ".png", ".json", ".jsonl"))


def command_line(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command as a user would type it: recorded environment variables, then python and args."""
    argv = list(sys.argv if argv is None else argv)
    env = [f"{name}={os.environ[name]}" for name in ENV_RECORDED if name in os.environ]
    if module:
        words = ["python", "-m", module, *argv[1:]]
    else:
        script = argv[0] if argv else "?"
        with contextlib.suppress(ValueError):
            script = str(Path(script).resolve().relative_to(REPO_ROOT))
        words = ["python", script, *argv[1:]]
    return " ".join(env + [shlex.join(words)])


def provenance(argv: list[str] | None = None, module: str | None = None) -> dict[str, Any]:
    return {
        "command": command_line(argv, module),
        "commit": git_commit(),
        "dirty_files": dirty_files(),
        "machine": machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def settings_dict(namespace: Any) -> dict[str, Any]:
    """An argparse namespace as JSON-safe settings (paths as strings)."""
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(namespace).items()}


def machine_summary(mach: dict[str, Any] | str | None) -> str:
    """One line for a caption: ``x86_64, 2 CPUs (AMD EPYC), 24.0 GiB, GPU none, load 3.1``."""
    if mach is None:
        return "unknown machine"
    if isinstance(mach, str):
        return mach
    if "nproc" not in mach:  # a dict some older writer recorded: show it as it is
        return ", ".join(f"{key} {value}" for key, value in mach.items())
    parts = [str(mach.get("arch", "?")), f"{mach.get('nproc', '?')} CPUs ({mach.get('cpu', '?')})"]
    if mach.get("mem_gib") is not None:
        parts.append(f"{mach['mem_gib']} GiB")
    parts.append(f"GPU {mach.get('gpu', '?')}")
    load = mach.get("loadavg")
    if load:
        parts.append(f"load avg {load[0]}")
    return ", ".join(parts)


def load_at_end(prov: dict[str, Any]) -> str:
    end = prov.get("machine_end")
    if isinstance(end, dict) and end.get("loadavg"):
        return f" (load avg at the end {end['loadavg'][0]})"
    return ""


def stamp(prov: dict[str, Any] | None) -> str:
    """The caption every table and figure carries: machine, commit, command."""
    if not prov:
        return "provenance not recorded"
    when = f"; run {prov['time_utc']}" if prov.get("time_utc") else ""
    return (f"machine: {machine_summary(prov.get('machine'))}{load_at_end(prov)}; "
            f"commit {prov.get('commit', 'not recorded')}{when}; command: {prov.get('command', 'not recorded')}")


def stamp_figure(fig: Any, prov: dict[str, Any] | None) -> None:
    """Write ``stamp(prov)`` along the bottom of a matplotlib figure (leave ~6% of height free)."""
    fig.text(0.01, 0.005, stamp(prov), fontsize=6, va="bottom", wrap=True)
