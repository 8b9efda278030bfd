"""Pure parts of the bench_serving sweep: read SGLang's bench_serving JSONL, tabulate, plot.

``python -m sglang.bench_serving --output-file F`` appends one JSON object per run to ``F`` (with
``--output-details`` it also carries per-request ``input_lens``, ``ttfts``, ``itls`` and
``errors``). A run in which no request succeeded writes no line at all, so a missing line is a
failed run, never a zero. ``parse_run`` keeps the headline metrics under our own names;
``sweep_table`` renders one row per (mode, request rate); ``plot_sweep`` draws TTFT, TPOT and
output throughput against the request rate, one line per mode.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmark import jsonl

# our name -> bench_serving's key
METRICS = {
    "completed": "completed",
    "duration_s": "duration",
    "request_throughput": "request_throughput",
    "input_throughput": "input_throughput",
    "output_throughput": "output_throughput",
    "mean_ttft_ms": "mean_ttft_ms",
    "median_ttft_ms": "median_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "mean_itl_ms": "mean_itl_ms",
    "median_itl_ms": "median_itl_ms",
    "p99_itl_ms": "p99_itl_ms",
    "mean_tpot_ms": "mean_tpot_ms",
    "median_tpot_ms": "median_tpot_ms",
    "p99_tpot_ms": "p99_tpot_ms",
    "mean_e2e_latency_ms": "mean_e2e_latency_ms",
    "total_input_tokens": "total_input_tokens",
    "total_output_tokens": "total_output_tokens",
    "concurrency": "concurrency",
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` (empty list when the file does not exist)."""
    return jsonl.read_jsonl(path, missing_ok=True)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def parse_run(raw: dict[str, Any], mode: str, num_prompts: int) -> dict[str, Any]:
    """One bench_serving result object -> our row (metrics absent from ``raw`` become None)."""
    row: dict[str, Any] = {"mode": mode, "request_rate": _finite(raw.get("request_rate")),
                           "num_prompts": num_prompts, "error": ""}
    for ours, theirs in METRICS.items():
        row[ours] = _finite(raw.get(theirs))
    errors = [e for e in raw.get("errors") or [] if e]
    row["failed_requests"] = len(errors) if "errors" in raw else num_prompts - int(row["completed"] or 0)
    if errors:
        row["first_error"] = str(errors[0])[:300]
    input_lens = raw.get("input_lens") or []
    row["mean_input_len"] = statistics.fmean(input_lens) if input_lens else None
    return row


def failed_run(mode: str, request_rate: float, num_prompts: int, error: str) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "request_rate": request_rate, "num_prompts": num_prompts,
                           "error": error, "failed_requests": num_prompts, "mean_input_len": None}
    row.update(dict.fromkeys(METRICS))
    return row


def last_run(path: Path, mode: str, request_rate: float, num_prompts: int, error: str = "") -> dict[str, Any]:
    """The last line of one run's output file as a row, or a failed row saying why there is none."""
    runs = read_jsonl(path)
    if not runs:
        return failed_run(mode, request_rate, num_prompts, error or f"bench_serving wrote no result to {path.name}")
    row = parse_run(runs[-1], mode, num_prompts)
    if row["request_rate"] is None:  # bench_serving writes inf as Infinity; keep what was asked
        row["request_rate"] = request_rate
    row["error"] = error
    return row


def merge_rows(old_rows: list[dict[str, Any]], new_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of an earlier sweep with the new run's rows put in place of the same (mode, rate);
    new (mode, rate) pairs are appended. Each row keeps its own ``run_utc``."""
    fresh = {(r["mode"], r["request_rate"]): r for r in new_rows}
    merged = [fresh.pop((r["mode"], r["request_rate"]), r) for r in old_rows]
    return merged + [r for r in new_rows if (r["mode"], r["request_rate"]) in fresh]


def _cell(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | req/s | done | failed | mean in | TTFT mean (ms) | TTFT p99 | ITL mean (ms) | ITL p99 "
        "| TPOT mean (ms) | out tok/s | req/s done | concurrency | load after | run (UTC) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        done = "-" if r["completed"] is None else f"{int(r['completed'])}/{r['num_prompts']}"
        lines.append(
            f"| {r['mode']} | {_cell(r['request_rate'], 3)} | {done} | {r['failed_requests']} "
            f"| {_cell(r['mean_input_len'], 0)} | {_cell(r['mean_ttft_ms'])} | {_cell(r['p99_ttft_ms'])} "
            f"| {_cell(r['mean_itl_ms'])} | {_cell(r['p99_itl_ms'])} | {_cell(r['mean_tpot_ms'])} "
            f"| {_cell(r['output_throughput'], 2)} | {_cell(r['request_throughput'], 3)} "
            f"| {_cell(r['concurrency'], 2)} | {_cell(r.get('load_1m_after'))} | {str(r.get('run_utc') or '-')[:16]} |"
        )
    notes = [f"- {r['mode']} at {r['request_rate']} req/s: {r['error'] or r.get('first_error')}"
             for r in rows if r["error"] or r.get("first_error")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


PANELS = (("mean_ttft_ms", "TTFT mean (ms)"), ("mean_tpot_ms", "TPOT mean (ms)"),
          ("mean_itl_ms", "ITL mean (ms)"), ("output_throughput", "output tokens/s"))


def plot_sweep(rows: list[dict[str, Any]], path: Path, caption: str) -> Path:
    """One panel per metric, x = request rate, one line per mode; failed runs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["completed"]]
    if not ok:
        raise ValueError("no successful bench_serving run to plot")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.0 * len(PANELS), 3.6))
    for axis, (key, label) in zip(axes, PANELS, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in ok):
            points = sorted((r["request_rate"], r[key]) for r in ok if r["mode"] == mode and r[key] is not None)
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
