"""Does a request that drafted decode slower after its verify? Read committed TTkT runs and compare, per
cell, the late decode pace (tokens 33-64, :func:`benchmark.serving.ttkt_report.late_pace`) of every mode
with ``int8``'s (the same KV precision after the upgrade, never drafts) in the same run.

Usage::

    python benchmark/serving/token_pace.py benchmark/serving/results/ttkt-sweep-1k ... --out FILE.json

Each argument is a ``bench_ttkt.py`` output directory (its ``ttkt-rows.jsonl``). Prints one table per run
(mode, context, ratio, n, median drafts, late pace median and min-max in ms, pace / int8's) and writes
``--out`` (JSON: provenance, the runs read, the rows of those tables). A cell's pace is the median of its
requests' paces; the modes of one run ran one after another on the same machine, so the spread of one
mode's requests is the yardstick for a difference between modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.provenance import provenance  # noqa: E402
from benchmark.serving.ttkt_report import late_pace  # noqa: E402


def pace_cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (mode, context, ratio) in first-seen order: requests with a late pace, their median
    drafts, the median / min / max late pace (s) and the median over ``int8``'s in the same cell."""
    cells: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for row in rows:
        if not row.get("error"):
            cells.setdefault((row["mode"], row["context"], row["ratio"]), []).append(row)
    out = []
    for (mode, context, ratio), sel in cells.items():
        paces = [p for p in (late_pace(r) for r in sel) if p is not None]
        drafts = [r.get("lynx_drafts") or 0 for r in sel]
        out.append({"mode": mode, "context": context, "ratio": ratio, "n": len(paces),
                    "drafts_median": statistics.median(drafts),
                    "pace_s": statistics.median(paces) if paces else None,
                    "pace_min_s": min(paces, default=None), "pace_max_s": max(paces, default=None)})
    for entry in out:
        int8 = next((e for e in out if e["mode"] == "int8" and (e["context"], e["ratio"]) ==
                     (entry["context"], entry["ratio"])), None)
        base = None if int8 is None else int8["pace_s"]
        entry["over_int8"] = None if base is None or entry["pace_s"] is None else entry["pace_s"] / base
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def table_lines(run: str, cells: list[dict[str, Any]]) -> list[str]:
    lines = [f"{run}:", "| mode | context | ratio | n | drafts | late pace ms (min-max) | / int8 |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        ratio = "-" if c["over_int8"] is None else f"{c['over_int8']:.3f}"
        lines.append(f"| {c['mode']} | {c['context']} | {c['ratio']:g} | {c['n']} | {c['drafts_median']:g} | "
                     f"{_ms(c['pace_s'])} ({_ms(c['pace_min_s'])}-{_ms(c['pace_max_s'])}) | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench_ttkt.py output directories")
    parser.add_argument("--out", type=Path, help="write the tables as JSON here")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"provenance": provenance(argv), "runs": {}}
    for run in args.runs:
        rows = [json.loads(line) for line in (run / "ttkt-rows.jsonl").read_text().splitlines() if line.strip()]
        cells = pace_cells(rows)
        result["runs"][run.name] = cells
        print("\n".join(table_lines(run.name, cells)) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
