"""The accuracy area of the report: every per-mode grid run_modes wrote, shown as one summary.

``run_modes`` writes one ``accuracy_modes.json`` per grid (for instance 1K/2K in ``results/grid``
and 4K in ``results/grid-4k``). ``combine_grids`` takes every such file with its recorded run time
and, for each context length, keeps the newest grid that measured it, so the cells of two grids
never mix (a grid that is newest for one context length does not replace another grid's other
lengths). For each kept grid it reads the records the file was aggregated from
(``<dir>/<mode>.jsonl``, the runner's output) for the context lengths it supplies; a missing
records file raises ``ValueError`` (the report then says so instead of showing a partial table).
The result is plain data for ``tables.accuracy_grids_table`` and ``figures.draw_accuracy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmark.accuracy.aggregate import Record, load_records
from benchmark.reporting.sources import newest_per_context, provenance_of, relative


def grid_contexts(data: Any) -> list[int]:
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError("results file has no 'rows'")
    return sorted({int(row["context_tokens"]) for row in rows})


def select_grids(files: list[tuple[str, Path, Any]]) -> list[tuple[Path, Any, list[int]]]:
    """``(path, data, context lengths it supplies)`` per kept grid: each context length goes to the newest
    grid that has it (``sources.newest_per_context``). Ordered by context length."""
    return newest_per_context(files, grid_contexts)


def grid_records(path: Path, data: Any, contexts: list[int]) -> list[Record]:
    """The records of every mode of the grid at ``path`` (``<dir>/<mode>.jsonl``) at ``contexts``."""
    records = []
    for mode in dict.fromkeys(str(row["mode"]) for row in data["rows"]):
        source = path.parent / f"{mode}.jsonl"
        if not source.exists():
            raise ValueError(f"{source} is missing (the records {path.name} was aggregated from)")
        records += [r for r in load_records(source) if int(r["context_tokens_target"]) in contexts]
    return records


def combine_grids(files: list[tuple[str, Path, Any]], root: Path) -> dict[str, Any]:
    grids = []
    for path, data, contexts in select_grids(files):
        grids.append({
            "source": relative(path, root),
            "details": relative(path.with_suffix(".md"), root),
            "provenance": provenance_of(data, path, root),
            "contexts": contexts,
            "rows": [row for row in data["rows"] if int(row["context_tokens"]) in contexts],
            "skipped_modes": data.get("skipped_modes") or {},
            "mode_run_utc": data.get("mode_run_utc") or {},  # a --merge run: modes kept from an earlier run
            "earlier_provenance": data.get("earlier_provenance") or [],
            "records": grid_records(path, data, contexts),
        })
    if not grids:
        raise ValueError("no accuracy grid found")
    return {"grids": grids}
