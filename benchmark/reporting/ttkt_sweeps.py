"""The TTkT area of the report: the shaped-link sweep, one run per prompt length, shown as one section.

``bench_ttkt.py`` measures every mode of one run on one deployment per mode, at the context lengths and ratios
it was given. The sweep of issue 14 (raw and the Lynx modes at 1.4K, 5.6K and ~8K prompt tokens) does not fit
one run on this CPU, so it is several runs (``results/ttkt-sweep-1k``, ``-5k``, ``-8k``;
``results/ttkt-shaped``, the older 1.4K run, is kept and superseded). ``combine_sweeps`` takes every such file
with its recorded run time and, for each context length, keeps the newest run that measured it, so the cells
of two runs never mix within one context length (the modes of one length were measured on the same link, in
the same run, against the same calibration). Each kept run is shown with its own provenance, calibration and
tables. The result is plain data for ``tables.ttkt_table`` and ``figures.draw_ttkt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmark.reporting.sources import newest_per_context, provenance_of, relative


def run_contexts(data: Any) -> list[int]:
    """Context lengths (the ``--context-tokens`` values) of a ratio sweep's table."""
    table = data.get("table") if isinstance(data, dict) else None
    if not isinstance(table, list) or not table:
        raise ValueError("results file has no 'table'")
    if any("ratio" not in row for row in table):
        raise ValueError("results file is not a ratio sweep (a table row has no 'ratio')")
    return sorted({int(row["context"]) for row in table})


def select_runs(files: list[tuple[str, Path, Any]]) -> list[tuple[Path, Any, list[int]]]:
    """``(path, data, context lengths it supplies)`` per kept run: each context length goes to the newest run
    that has it (``sources.newest_per_context``). Ordered by context length."""
    return newest_per_context(files, run_contexts)


def _only(data: dict[str, Any], contexts: list[int]) -> dict[str, Any]:
    """The run's results restricted to ``contexts`` (table, rows and calibration)."""
    keep = set(contexts)
    out = dict(data)
    out["table"] = [row for row in data["table"] if int(row["context"]) in keep]
    out["rows"] = [row for row in data.get("rows") or [] if int(row.get("context", -1)) in keep]
    out["calibration"] = {k: v for k, v in (data.get("calibration") or {}).items() if int(k) in keep}
    return out


def combine_sweeps(files: list[tuple[str, Path, Any]], root: Path) -> dict[str, Any]:
    """``{"grids": [{"source", "provenance", "contexts", "data"}...]}``, ``data`` the run restricted to ``contexts``."""
    if not files:
        raise ValueError("no TTkT sweep results")
    grids = [{"source": relative(path, root), "provenance": provenance_of(data, path, root), "contexts": contexts,
              "data": _only(data, contexts)} for path, data, contexts in select_runs(files)]  # fmt: skip
    return {"grids": grids}
