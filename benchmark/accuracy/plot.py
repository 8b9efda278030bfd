"""Accuracy against context length, one line per mode, one panel per task (like the paper's Fig. 12).

Pure apart from writing the PNG. Error bars are the std across seeds. The figure is stamped with a
caption (machine, command) so a reader can reproduce it. matplotlib is imported lazily with the
Agg backend so the rest of the package works without it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from benchmark.accuracy.aggregate import AccuracyRow


def plot_accuracy_vs_context(rows: Sequence[AccuracyRow], path: Path, caption: str) -> Path:
    if not rows:
        raise ValueError("no accuracy rows to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in rows})
    columns = min(3, len(tasks))
    grid_rows = -(-len(tasks) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(max(7.0, 4.4 * columns), 3.4 * grid_rows + 1.0),
                             squeeze=False)
    modes = sorted({r.mode for r in rows})
    markers = "osD^vP*Xh"
    flat_axes = [axis for row in axes for axis in row]
    for axis in flat_axes[len(tasks) :]:
        axis.set_visible(False)
    for axis, task in zip(flat_axes, tasks, strict=False):
        by_mode: dict[str, list[AccuracyRow]] = defaultdict(list)
        for row in rows:
            if row.task == task:
                by_mode[row.mode].append(row)
        for mode in sorted(by_mode):
            points = sorted(by_mode[mode], key=lambda r: r.context_tokens)
            index = modes.index(mode)
            shift = 2 ** (0.04 * (index - (len(modes) - 1) / 2))  # modes with equal scores stay visible
            axis.errorbar(
                [p.context_tokens * shift for p in points],
                [p.mean for p in points],
                yerr=[p.std for p in points],
                marker=markers[index % len(markers)],
                capsize=3,
                label=mode,
                alpha=0.85,
            )
        contexts = sorted({r.context_tokens for r in rows if r.task == task})
        axis.set_title(task)
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, [str(c) for c in contexts])
        axis.minorticks_off()
        axis.set_xlabel("context length (tokens, target)")
        axis.set_ylabel("accuracy")
        axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.16 if grid_rows == 1 else 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
