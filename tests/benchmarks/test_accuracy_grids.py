"""The report's accuracy area: every run_modes grid combined, newest grid per context length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark.accuracy.run_modes import main
from benchmark.report import build_combined_section, collect, render_section
from benchmark.reporting.accuracy_grids import combine_grids, select_grids
from benchmark.reporting.figures import accuracy_grid_rows
from benchmark.reporting.sources import AREAS, all_results

AREA = next(a for a in AREAS if a.key == "accuracy")


def rec(mode: str, task: str, context: int, seed: int, depth: float, score: float, tokens: list[int]) -> dict[str, Any]:
    return {"mode": mode, "task": task, "context_tokens_target": context, "seed": seed, "score": score,
            "status": "ok", "instance_id": f"{task}/{context}/{seed}/{depth}", "token_kind": "ids",
            "output_tokens": tokens}


def grid_records(mode: str, context: int, scores: list[float], tokens: list[list[int]],
                 extra_task: bool = False) -> list[dict[str, Any]]:
    """Two seeds x (needle_single at depth 0, document_qa at depth 0); ``extra_task`` adds kv_retrieval."""
    out = []
    for i, (seed, task) in enumerate((s, t) for s in (0, 1) for t in ("needle_single", "document_qa")):
        out.append(rec(mode, task, context, seed, 0.0, scores[i], tokens[i]))
    if extra_task:
        out += [rec(mode, "kv_retrieval", context, seed, 0.0, 0.0, [0]) for seed in (0, 1)]
    return out


def write_grid(directory: Path, records: dict[str, list[dict[str, Any]]], when: str) -> Path:
    """A grid as run_modes writes it (--aggregate-only over the records), with its run time set."""
    directory.mkdir(parents=True)
    for mode, recs in records.items():
        (directory / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    main(["--aggregate-only", "--modes", *records, "--out", str(directory)])
    path = directory / "accuracy_modes.json"
    data = json.loads(path.read_text())
    data["provenance"]["time_utc"] = when
    data["mode_run_utc"] = dict.fromkeys(data["mode_run_utc"], when)
    data["provenance"]["commit"] = f"c-{directory.name}"
    path.write_text(json.dumps(data))
    return path


SAME = [[1], [2], [3], [4]]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    results = tmp_path / "benchmark" / "accuracy" / "results"
    small = {m: grid_records(m, c, [1, 1, 1, 0], SAME, extra_task=True) for m in ("bf16", "lynx-int8", "lynx")
             for c in (1024,)}
    small = {m: small[m] + grid_records(m, 2048, [1, 0, 1, 0], SAME, extra_task=True) for m in small}
    write_grid(results / "grid", small, "2026-12-01T12:00:00Z")
    big = {"bf16": grid_records("bf16", 4096, [1, 1, 0, 1], SAME),
           "lynx-int8": grid_records("lynx-int8", 4096, [1, 0, 0, 1], [[1], [9], [3], [4]]),
           "lynx": grid_records("lynx", 4096, [1, 0, 0, 1], [[1], [9], [3], [4]])}
    write_grid(results / "grid-4k", big, "2026-12-01T14:00:00Z")
    # an older grid of 1K only: replaced by the newer grid for 1K, so it must not show
    write_grid(results / "modes", {"bf16": grid_records("bf16", 1024, [0, 0, 0, 0], SAME)}, "2026-12-01T08:00:00Z")
    return tmp_path


def test_each_context_comes_from_the_newest_grid_that_has_it(repo: Path) -> None:
    chosen = select_grids(all_results(AREA, repo))
    assert [(p.parent.name, contexts) for p, _, contexts in chosen] == [("grid", [1024, 2048]), ("grid-4k", [4096])]
    newer_1k = [(w, p, d) for w, p, d in all_results(AREA, repo)]
    newer_1k[0] = ("2026-12-01T15:00:00Z", *newer_1k[0][1:])  # make the 1K-only grid the newest
    assert [(p.parent.name, c) for p, _, c in select_grids(newer_1k)] == [
        ("modes", [1024]), ("grid", [2048]), ("grid-4k", [4096])]


def test_combined_section_has_every_grid_stamped_and_a_summary_per_mode(repo: Path) -> None:
    section = build_combined_section(AREA, all_results(AREA, repo), repo, repo / "fig")
    assert section.problem == ""
    text = render_section(section)
    assert "- Context 1024, 2048: `benchmark/accuracy/results/grid/accuracy_modes.json`" in text
    assert "- Context 4096: `benchmark/accuracy/results/grid-4k/accuracy_modes.json`" in text
    assert "  - Commit: c-grid; run 2026-12-01T12:00:00Z" in text and "  - Commit: c-grid-4k;" in text
    assert "modes/accuracy_modes.json" not in text
    # 1K: seed 0 (1 + 1) / 2, seed 1 (1 + 0) / 2 -> 75 +- 25; 4K lynx: seeds 0.5 and 0.5 -> 25 points under bf16
    assert "| bf16 | 75.0 +- 25.0 (50-100) | - | - | 50.0 +- 0.0 (50-50) | - | - | 75.0 +- 25.0 (50-100) | - | - |" \
        in text
    assert "| lynx | 75.0 +- 25.0 (50-100) | +0.0 | 4/4 | 50.0 +- 0.0 (50-50) | +0.0 | 4/4 " \
        "| 50.0 +- 0.0 (50-50) | -25.0 | 3/4 |" in text
    assert "Left out of the means (not measured at every context length): kv_retrieval." in text
    assert "lynx against lynx-int8 (the KV it verifies on)" in text and "1K 6/6, 2K 6/6, 4K 4/4" in text
    assert "2 seeds, 12 instances per mode (all its tasks)" in text and "2 seeds, 4 instances per mode" in text
    assert "`benchmark/accuracy/results/grid-4k/accuracy_modes.md`" in text
    assert section.figure == "fig/accuracy.png" and (repo / "fig" / "accuracy.png").stat().st_size > 1000


def test_figure_rows_cover_the_summary_tasks_and_their_mean(repo: Path) -> None:
    rows = accuracy_grid_rows(combine_grids(all_results(AREA, repo), repo))
    assert {r.task for r in rows} == {"document_qa", "needle_single", "mean over 2 tasks"}
    assert sorted({r.context_tokens for r in rows}) == [1024, 2048, 4096]


def test_a_grid_without_its_records_is_reported_not_half_shown(repo: Path) -> None:
    (repo / "benchmark" / "accuracy" / "results" / "grid-4k" / "lynx.jsonl").unlink()
    section = build_combined_section(AREA, all_results(AREA, repo), repo, None)
    assert "could not be combined" in section.problem and "lynx.jsonl is missing" in section.problem
    assert section.table == "" and "could not be combined" in render_section(section)


def test_collect_uses_the_combined_accuracy_section(repo: Path) -> None:
    (section,) = [s for s in collect(repo, None) if s.area.key == "accuracy"]
    assert [what for _, _, what in section.grids] == ["context 1024, 2048", "context 4096"]
    assert section.prov["commit"] == "c-grid-4k"


def test_modes_a_merge_run_kept_from_an_earlier_run_are_named(repo: Path) -> None:
    grid = repo / "benchmark" / "accuracy" / "results" / "grid-4k"
    assert main(["--aggregate-only", "--merge", "--modes", "bf16", "--out", str(grid)]) == 0
    text = render_section(build_combined_section(AREA, all_results(AREA, repo), repo, None))
    assert "  - modes kept from an earlier run of that grid: " in text
    assert "lynx-int8 (run 2026-12-01T14:00:00Z)" in text and "lynx (run 2026-12-01T14:00:00Z)" in text
    assert "bf16 (run" not in text
    assert "  - earlier run: machine:" in text and "commit c-grid-4k" in text
    assert text.count("modes kept from an earlier run") == 1  # the 1K/2K grid was not merged
