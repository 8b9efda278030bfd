"""The report's TTkT area: the shaped-link sweep, each (context, ratio) cell from the newest run that has it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark.report import collect, render_section
from benchmark.reporting.sources import AREAS, all_results
from benchmark.reporting.ttkt_sweeps import combine_sweeps, select_runs
from benchmark.serving.ttkt_report import summarize

AREA = next(a for a in AREAS if a.key == "ttkt")


def _row(mode: str, context: int, ratio: float, t1: float) -> dict[str, Any]:
    times = [t1 + 0.1 * i for i in range(64)]
    return {"mode": mode, "context": context, "ratio": ratio, "link_gbps": 0.5, "seed": 0, "error": "",
            "found": True, "token_times": times, "tt1t": t1, "tt8t": times[7], "tt32t": times[31],
            "tt64t": times[63], "lynx_drafts": None, "lynx_accepted": None, "lynx_verify_s": None,
            "lynx_anchor_landed_s": None, "lynx_residual_landed_s": None, "lynx_fallback": None}


def write_run(repo: Path, name: str, contexts: list[int], when: str, commit: str, tt1t: float,
              ratios: tuple[float, ...] = (16.0, 64.0)) -> Path:
    rows = [_row(mode, c, r, tt1t + (1.0 if mode == "raw" else 0.0))
            for c in contexts for r in ratios for mode in ("raw", "int8", "lynx")]  # fmt: skip
    data = {"provenance": {"command": f"bench_ttkt.py --out {name}", "commit": commit, "time_utc": when},
            "link": "netns+veth+tc-tbf", "rows": rows, "table": summarize(rows),
            "calibration": {str(c): {"prompt_tokens": c + 300, "step_s": 0.05, "tt1t_floor_s": 1.0}
                            for c in contexts}}  # fmt: skip
    path = repo / "benchmark" / "serving" / "results" / name / "ttkt.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_run(tmp_path, "ttkt-shaped", [1024, 4096], "2026-12-01T10:00:00Z", "old1111", 2.0)
    write_run(tmp_path, "ttkt-sweep-5k", [4096], "2026-12-05T10:00:00Z", "new2222", 20.0)
    write_run(tmp_path, "ttkt-sweep-8k", [5750], "2026-12-05T11:00:00Z", "new2222", 35.0)
    write_run(tmp_path, "ttkt-layers-5k", [4096], "2026-12-06T10:00:00Z", "study33", 9.0)  # not the sweep's
    return tmp_path


def test_each_cell_comes_from_the_newest_sweep_run_that_has_it(repo: Path) -> None:
    chosen = select_runs(all_results(AREA, repo))
    assert [(p.parent.name, c) for p, _, c in chosen] == [
        ("ttkt-shaped", [(1024, 16.0), (1024, 64.0)]), ("ttkt-sweep-5k", [(4096, 16.0), (4096, 64.0)]),
        ("ttkt-sweep-8k", [(5750, 16.0), (5750, 64.0)])]
    # a later run of ratio 4 alone adds its cell and hides none of the earlier run's other ratios
    write_run(repo, "ttkt-sweep-5k-r4", [4096], "2026-12-07T10:00:00Z", "r4r4444", 30.0, ratios=(4.0,))
    write_run(repo, "ttkt-sweep-1k-again", [1024], "2026-12-07T11:00:00Z", "again55", 3.0, ratios=(64.0,))
    chosen = select_runs(all_results(AREA, repo))
    assert [(p.parent.name, c) for p, _, c in chosen] == [
        ("ttkt-shaped", [(1024, 16.0)]), ("ttkt-sweep-1k-again", [(1024, 64.0)]),
        ("ttkt-sweep-5k-r4", [(4096, 4.0)]), ("ttkt-sweep-5k", [(4096, 16.0), (4096, 64.0)]),
        ("ttkt-sweep-8k", [(5750, 16.0), (5750, 64.0)])]
    data = combine_sweeps(all_results(AREA, repo), repo)
    assert [g["label"] for g in data["grids"]] == [
        "context 1024, ratio 16", "context 1024, ratio 64", "context 4096, ratio 4", "context 4096, ratios 16, 64",
        "context 5750, ratios 16, 64"]
    again = data["grids"][1]["data"]
    assert {(e["context"], e["ratio"]) for e in again["table"]} == {(1024, 64.0)}
    assert {(r["context"], r["ratio"]) for r in again["rows"]} == {(1024, 64.0)}


def test_a_kept_run_shows_only_the_lengths_it_supplies(repo: Path) -> None:
    data = combine_sweeps(all_results(AREA, repo), repo)
    shaped = data["grids"][0]["data"]
    assert {e["context"] for e in shaped["table"]} == {1024} and list(shaped["calibration"]) == ["1024"]
    assert {r["context"] for r in shaped["rows"]} == {1024}
    rows = [e for grid in data["grids"] for e in grid["data"]["table"]]
    assert {e["context"] for e in rows} == {1024, 4096, 5750} and len(rows) == 18


def test_the_section_has_every_run_stamped_and_its_tables(repo: Path) -> None:
    (section,) = [s for s in collect(repo, figures_dir=repo / "fig") if s.area.key == "ttkt"]
    assert section.problem == ""
    text = render_section(section)
    for name, commit in (("ttkt-shaped", "old1111"), ("ttkt-sweep-5k", "new2222"), ("ttkt-sweep-8k", "new2222")):
        assert f"`benchmark/serving/results/{name}/ttkt.json`" in text and f"Commit: {commit}" in text
    assert "ttkt-layers-5k" not in text and "study33" not in text
    assert "| lynx | 4096 | 64 | 0.500 | 1 | 0 | 20.00 |" in text  # the 5.6K run's cell, not the older one's
    assert "| lynx | 4096 | 64 | 0.500 | 1 | 0 | 2.00 |" not in text
    assert "| 5750 | 64 | 1.00 | 1.03 |" in text  # headline: TT1T(int8)/TT1T(lynx), TT1T(raw)/TT1T(lynx)
    assert section.figure == "fig/ttkt.png" and (repo / "fig" / "ttkt.png").stat().st_size > 1000


def test_a_run_that_is_not_a_ratio_sweep_is_reported_not_half_shown(repo: Path) -> None:
    path = repo / "benchmark" / "serving" / "results" / "ttkt-sweep-old" / "ttkt.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"provenance": {"time_utc": "2026-12-07T00:00:00Z"},
                                "table": [{"mode": "lynx", "context": 1024, "n": 1}]}))
    (section,) = [s for s in collect(repo, figures_dir=None) if s.area.key == "ttkt"]
    assert "not a ratio sweep" in section.problem and section.table == ""
