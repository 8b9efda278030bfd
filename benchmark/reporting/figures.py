"""PNG figures for the report, each drawn from one results file and stamped with its provenance.

``FIGURES`` maps an area key to ``draw(data, path, caption) -> Path``; areas without an entry get a
table only. The serving sweep and accuracy figures reuse their benchmarks' own plot functions;
the others are simple bar charts. matplotlib is imported lazily with the Agg backend.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmark.accuracy.aggregate import AccuracyRow
from benchmark.accuracy.plot import plot_accuracy_vs_context
from benchmark.reporting.tables import TTKT_KS, accuracy_rows_of, accuracy_summaries
from benchmark.serving.serving_results import plot_sweep


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig: Any, path: Path, caption: str) -> Path:
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _bar_axes(ax: Any, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str,
              errors: dict[str, list[float]] | None = None) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        err = (errors or {}).get(name)
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=name, yerr=err, capsize=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize=8)


def _bars(groups: list[str], series: dict[str, list[float]], ylabel: str, title: str, path: Path,
          caption: str, errors: dict[str, list[float]] | None = None) -> Path:
    if not groups or not series:
        raise ValueError(f"nothing to plot for {title}")
    fig, ax = _pyplot().subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.2))
    _bar_axes(ax, groups, series, ylabel, title, errors)
    return _finish(fig, path, caption)


def draw_codec_drafts(data: Any, path: Path, caption: str) -> Path:
    summary = [s for s in data["summary"] if s.get("accepted")]
    groups = [str(s["variant"]) for s in summary]
    return _bars(groups, {"tokens kept": [s["accepted"][0] for s in summary]}, "tokens kept (mean)",
                 f"Greedy draft tokens kept of {data['meta'].get('draft', '?')}", path, caption,
                 {"tokens kept": [s["accepted"][1] for s in summary]})


def draw_kernels(data: Any, path: Path, caption: str) -> Path:
    rows = data["rows"]
    groups = [f"{r['path']} {r['tokens']} tok" for r in rows]
    series = {"encode / copy": [100 * r.get("encode_of_copy", 0) for r in rows],
              "decode / copy": [100 * r.get("decode_full_of_copy", 0) for r in rows]}
    return _bars(groups, series, "% of memory-copy bandwidth", "Codec throughput vs memory copy", path, caption)


def draw_transfer(data: Any, path: Path, caption: str) -> Path:
    rows = [r for r in data["rows"] if "ctx" in r]
    groups = [f"{r['link_gbps']:g} Gb/s, {r['ctx']} tok" for r in rows]
    series = {"scheduler overhead vs raw (%)": [100 * r["overhead_e2e"] for r in rows]}
    return _bars(groups, series, "% over raw Mooncake", "Two-priority scheduler vs raw Mooncake", path, caption)


def _ttkt_bars(table: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    groups = [f"{e['mode']} ({e['context']}" + (f", r{e['ratio']:g})" if "ratio" in e else ")") for e in table]
    series = {f"TT{k}T": [e.get(f"tt{k}t") or 0.0 for e in table] for k in TTKT_KS
              if any(e.get(f"tt{k}t") for e in table)}
    return groups, series


def draw_ttkt(data: Any, path: Path, caption: str) -> Path:
    if not (isinstance(data, dict) and "grids" in data):
        return _bars(*_ttkt_bars(data["table"]), "seconds (median)", "Time to the k-th token per mode", path, caption)
    grids = data["grids"]  # the sweep (ttkt_sweeps.py): one panel per kept run and its (context, ratio) cells
    widest = max(len(grid["data"]["table"]) for grid in grids)
    fig, axes = _pyplot().subplots(len(grids), 1, figsize=(max(6.0, 0.9 * widest + 2), 4.2 * len(grids)),
                                   squeeze=False)
    for ax, grid in zip(axes[:, 0], grids, strict=True):
        groups, series = _ttkt_bars(grid["data"]["table"])
        if not groups or not series:
            raise ValueError(f"nothing to plot for {grid['source']}")
        _bar_axes(ax, groups, series, "seconds (median)", f"Time to the k-th token per mode, {grid['label']}")
    return _finish(fig, path, caption)


def draw_serving(data: Any, path: Path, caption: str) -> Path:
    return plot_sweep(data["rows"], path, caption)


def accuracy_grid_rows(data: Any) -> list[AccuracyRow]:
    """Per-task rows of every grid (the tasks of the summary) and the summary itself as one more
    'task' (the mean over those tasks), for the accuracy-vs-context figure."""
    summaries = accuracy_summaries(data)
    tasks = set(summaries[0].tasks)
    rows = [AccuracyRow(**row) for grid in data["grids"] for row in grid["rows"] if row["task"] in tasks]
    label = f"mean over {len(tasks)} tasks"
    return rows + [AccuracyRow(s.mode, label, s.context_tokens, s.mean, s.std, s.minimum, s.maximum, s.seeds,
                               s.instances, s.errors) for s in summaries]


def draw_accuracy(data: Any, path: Path, caption: str) -> Path:
    if isinstance(data, dict) and "grids" in data:
        return plot_accuracy_vs_context(accuracy_grid_rows(data), path, caption)
    return plot_accuracy_vs_context(accuracy_rows_of(data), path, caption)


FIGURES: dict[str, Callable[[Any, Path, str], Path]] = {
    "codec_drafts": draw_codec_drafts,
    "kernels": draw_kernels,
    "transfer": draw_transfer,
    "ttkt": draw_ttkt,
    "serving": draw_serving,
    "accuracy": draw_accuracy,
}
