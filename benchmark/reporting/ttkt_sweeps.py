"""The TTkT area of the report: the shaped-link sweep, one run per prompt length, shown as one section.

``bench_ttkt.py`` measures every mode of one run on one deployment per mode, at the context lengths and ratios
it was given. The sweep of issue 14 (raw and the Lynx modes at 1.4K, 5.6K and ~8K prompt tokens) does not fit
one run on this CPU, so it is several runs (``results/ttkt-sweep-1k``, ``-5k``, ``-8k``, ``-5k-r4-all``...;
``results/ttkt-shaped``, the older 1.4K run, is kept and superseded). ``combine_sweeps`` takes every such file
with its recorded run time and, for each (context length, ratio) cell, keeps the newest run that measured it,
so the modes of one cell always come from one run (measured on the same link, in the same run, against the
same calibration) and a later run of one ratio does not hide an earlier run's other ratios. Each kept run is
shown with its own provenance, calibration and tables. The result is plain data for ``tables.ttkt_table`` and
``figures.draw_ttkt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmark.reporting.sources import newest_per_context, provenance_of, relative


def run_cells(data: Any) -> list[tuple[int, float]]:
    """(context length, ratio) cells of a ratio sweep's table."""
    table = data.get("table") if isinstance(data, dict) else None
    if not isinstance(table, list) or not table:
        raise ValueError("results file has no 'table'")
    if any("ratio" not in row for row in table):
        raise ValueError("results file is not a ratio sweep (a table row has no 'ratio')")
    return sorted({(int(row["context"]), float(row["ratio"])) for row in table})


def select_runs(files: list[tuple[str, Path, Any]]) -> list[tuple[Path, Any, list[tuple[int, float]]]]:
    """``(path, data, cells it supplies)`` per kept run: each (context, ratio) cell goes to the newest run that
    has it (``sources.newest_per_context``). Ordered by cell."""
    return newest_per_context(files, run_cells)


def _only(data: dict[str, Any], cells: list[tuple[int, float]]) -> dict[str, Any]:
    """The run's results restricted to ``cells`` (table, rows and the calibration of their contexts)."""
    keep = set(cells)
    contexts = {c for c, _ in cells}
    out = dict(data)
    out["table"] = [row for row in data["table"] if (int(row["context"]), float(row["ratio"])) in keep]
    out["rows"] = [row for row in data.get("rows") or []
                   if (int(row.get("context", -1)), float(row.get("ratio", -1))) in keep]
    out["calibration"] = {k: v for k, v in (data.get("calibration") or {}).items() if int(k) in contexts}
    return out


def cells_label(cells: list[tuple[int, float]]) -> str:
    """``context 4096, ratios 16, 64`` per context length of ``cells``, joined by ``; ``."""
    by_context: dict[int, list[float]] = {}
    for context, ratio in cells:
        by_context.setdefault(context, []).append(ratio)
    return "; ".join(f"context {c}, ratio{'s' if len(r) > 1 else ''} {', '.join(f'{x:g}' for x in r)}"
                     for c, r in by_context.items())


def combine_sweeps(files: list[tuple[str, Path, Any]], root: Path) -> dict[str, Any]:
    """``{"grids": [{"source", "provenance", "contexts", "cells", "label", "data"}...]}``, ``data`` the run
    restricted to ``cells``."""
    if not files:
        raise ValueError("no TTkT sweep results")
    grids = [{"source": relative(path, root), "provenance": provenance_of(data, path, root),
              "contexts": sorted({c for c, _ in cells}), "cells": cells, "label": cells_label(cells),
              "data": _only(data, cells)} for path, data, cells in select_runs(files)]  # fmt: skip
    return {"grids": grids}
