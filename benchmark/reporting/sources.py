"""Where each area's machine-readable results live, which file is the latest, and its provenance.

An ``Area`` names glob patterns (relative to the repository root) for its result files. The latest
file is the one with the newest recorded run time (``provenance.time_utc`` or ``meta.time``),
falling back to the time git last committed the file, then to its modification time. An area with
``combine`` (accuracy: one grid of context lengths per file; the TTkT sweep: one run per context
length) is rendered from all its files (``all_results``, each with that time) instead of the latest one.

Provenance: files written since benchmark/provenance.py existed carry ``"provenance"`` (machine
dict, commit, command, time). Older files recorded less (a command string, a machine string, maybe a
commit); ``provenance_of`` fills what it can from them and, when no run-time commit was recorded,
says which commit last changed the results file instead, marked as such.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmark.provenance import REPO_ROOT

K = TypeVar("K", int, tuple[int, float])  # what a combined area's files are kept by


@dataclass(frozen=True)
class Area:
    key: str
    title: str
    patterns: tuple[str, ...]
    combine: bool = False  # rendered from every results file (all_results), not only the latest


AREAS = (
    Area("codec_drafts", "Codec: draft tokens kept, errors, bits", ("benchmark/codec/results/drafts-*.json",)),
    Area("codec_throughput", "Codec: throughput (torch reference; lynx-exact C path on real KV)",
         ("benchmark/codec/results/throughput*.json",)),
    Area("kernels", "Kernels: codec throughput vs memory copy", ("benchmark/kernels/results/throughput*.json",)),
    Area("page_reuse", "Codec: encode time with the prefill's encoded-page reuse",
         ("benchmark/codec/results/page_reuse.json",)),
    Area("transfer", "Transfer: scheduler vs raw Mooncake", ("benchmark/transfer/results*.json",)),
    Area("transfer_modes", "Transfer: anchor and residual landed per mode", ("benchmark/transfer/modes*.json",)),
    Area("ttkt", "Serving: time to the k-th token per mode (the shaped-link sweep)",
         ("benchmark/serving/results/ttkt-shaped/ttkt.json", "benchmark/serving/results/ttkt-sweep-*/ttkt.json"),
         combine=True),
    Area("serving", "Serving: bench_serving request-rate sweep per mode",
         ("benchmark/serving/results/serving.json", "benchmark/serving/results/serving-shaped/serving.json",
          "benchmark/serving/results/idle-*/serving.json")),  # per-mode sweeps, not the studies of one mode's settings
    Area("accuracy", "Accuracy per mode through PD deployments",
         ("benchmark/accuracy/results/modes/accuracy_modes.json", "benchmark/accuracy/results/*/accuracy_modes.json"),
         combine=True),
    Area("decode", "Decode: extend (verify) vs decode kernels", ("benchmark/decode/results/extend_vs_decode-*.json",)),
)


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _dict_at(data: Any, key: str) -> dict[str, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def recorded_time(data: Any) -> str:
    prov, meta = _dict_at(data, "provenance"), _dict_at(data, "meta")
    return str(prov.get("time_utc") or meta.get("time") or "").replace(" ", "T")


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from exc


def candidates(area: Area, root: Path = REPO_ROOT) -> list[Path]:
    return sorted({p for pattern in area.patterns for p in root.glob(pattern) if p.is_file()})


def all_results(area: Area, root: Path = REPO_ROOT) -> list[tuple[str, Path, Any]]:
    """``(run time, path, parsed content)`` of every results file of the area, oldest first."""
    found = []
    for path in candidates(area, root):
        data = load_json(path)
        when = recorded_time(data) or _git(root, "log", "-1", "--format=%cI", "--", str(path))
        if not when:
            when = f"mtime {path.stat().st_mtime:.0f}"
        found.append((when, path, data))
    return sorted(found, key=lambda item: (item[0], str(item[1])))


def newest_per_context(files: list[tuple[str, Path, Any]],
                       contexts_of: Callable[[Any], list[K]]) -> list[tuple[Path, Any, list[K]]]:
    """``(path, data, keys it supplies)`` per kept file, from ``(when, path, data)`` triples: each key
    (``contexts_of(data)``: a context length, or a (context, ratio) cell) goes to the newest file that has it,
    so two files' cells never mix within one key. Ordered by key (a combined area's files: accuracy grids, TTkT
    runs)."""
    newest: dict[K, tuple[str, Path, Any]] = {}
    for when, path, data in files:
        for context in contexts_of(data):
            if context not in newest or when >= newest[context][0]:
                newest[context] = (when, path, data)
    kept: dict[Path, tuple[Path, Any, list[K]]] = {}
    for context in sorted(newest):
        _, path, data = newest[context]
        kept.setdefault(path, (path, data, []))[2].append(context)
    return list(kept.values())


def relative(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it lies inside it, else as given."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def latest(area: Area, root: Path = REPO_ROOT) -> tuple[Path, Any] | None:
    """The area's latest results file and its parsed content, or None when it has none."""
    best: tuple[str, Path, Any] | None = None
    for when, path, data in all_results(area, root):
        if best is None or when >= best[0]:
            best = (when, path, data)
    return None if best is None else (best[1], best[2])


def provenance_of(data: Any, path: Path, root: Path = REPO_ROOT) -> dict[str, Any]:
    """Machine, commit, command and time of a results file, as far as it recorded them."""
    if isinstance(data, dict) and isinstance(data.get("provenance"), dict):
        return dict(data["provenance"])
    meta = _dict_at(data, "meta")
    top: dict[str, Any] = data if isinstance(data, dict) else {}
    prov: dict[str, Any] = {
        "command": meta.get("command") or top.get("command") or "not recorded",
        "machine": meta.get("machine") or top.get("machine") or "not recorded",
        "time_utc": meta.get("time") or "",
    }
    if meta.get("commit") or top.get("commit"):
        prov["commit"] = meta.get("commit") or top.get("commit")
    else:
        try:
            rel = str(path.resolve().relative_to(root))
        except ValueError:
            rel = str(path)
        last = _git(root, "log", "-1", "--format=%h", "--", rel)
        prov["commit"] = f"not recorded (file last committed in {last})" if last else "not recorded"
    return prov
