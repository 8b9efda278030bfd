"""Per-mode accuracy aggregation (run_modes.summarize) and its table/figure in the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark.accuracy.run_modes import build_parser, main, rows_from_json, runner_argv, summarize
from benchmark.report import build_section, render_section
from benchmark.reporting.sources import AREAS


def rec(mode: str, seed: int, depth: float, score: float, tokens: list[int], status: str = "ok") -> dict[str, Any]:
    return {"mode": mode, "task": "needle_single", "context_tokens_target": 1024, "seed": seed, "score": score,
            "status": status, "instance_id": f"needle_single/1024/{seed}/{depth}", "token_kind": "ids",
            "output_tokens": tokens}


RECORDS = {
    "bf16": [rec("bf16", 0, 0.0, 1.0, [1, 2, 3]), rec("bf16", 0, 1.0, 1.0, [4, 5]),
             rec("bf16", 1, 0.0, 1.0, [6, 7]), rec("bf16", 1, 1.0, 0.0, [8, 9])],
    "lynx-int8": [rec("lynx-int8", 0, 0.0, 1.0, [1, 2, 3]), rec("lynx-int8", 0, 1.0, 0.0, [4, 0]),
                  rec("lynx-int8", 1, 0.0, 0.0, [], status="timeout"), rec("lynx-int8", 1, 1.0, 0.0, [8, 9])],
}


def test_summary_spreads_across_seeds_and_counts_errors() -> None:
    summary = summarize(RECORDS)
    rows = {r.mode: r for r in rows_from_json(summary["rows"])}
    assert rows["bf16"].mean == pytest.approx(0.75) and rows["bf16"].std == pytest.approx(0.25)
    lynx = rows["lynx-int8"]
    assert (lynx.mean, lynx.std, lynx.minimum, lynx.maximum, lynx.errors) == (0.25, 0.25, 0.0, 0.5, 1)


def test_agreement_with_bf16_skips_failed_requests() -> None:
    (row,) = summarize(RECORDS)["agreement"]
    assert row["mode"] == "lynx-int8" and row["matched"] == 3
    assert row["identical_fraction"] == pytest.approx(2 / 3)
    assert row["accuracy_delta"] == pytest.approx(-1 / 3)


def test_no_reference_means_no_agreement() -> None:
    summary = summarize({"lynx-int8": RECORDS["lynx-int8"]})
    assert summary["agreement"] == [] and summary["agreement_table"] == ""


def test_lossless_check_compares_lynx_with_lynx_int8_instance_by_instance() -> None:
    lynx = [rec("lynx", 0, 0.0, 1.0, [1, 2, 3]), rec("lynx", 0, 1.0, 0.0, [4, 1]), rec("lynx", 1, 1.0, 0.0, [8, 9])]
    summary = summarize({**RECORDS, "lynx": lynx})
    (row,) = summary["lossless"]
    assert row["mode"] == "lynx" and row["matched"] == 3 and row["identical_fraction"] == pytest.approx(2 / 3)
    assert "accuracy - lynx-int8" in summary["lossless_table"]
    assert summarize(RECORDS)["lossless"] == [] and summarize(RECORDS)["lossless_table"] == ""


def test_runner_is_called_against_the_router_with_the_grid() -> None:
    args = build_parser().parse_args(["--tasks", "needle_single", "--seeds", "0,1", "--context-lengths", "1024",
                                      "--out", "/tmp/x"])
    argv = runner_argv("http://127.0.0.1:5", "lynx", "/m", args)
    joined = " ".join(argv)
    assert "-m benchmark.accuracy.run_eval --url http://127.0.0.1:5" in joined and "--mode lynx" in joined
    assert "--seeds 0,1" in joined and "--context-lengths 1024" in joined and "--tokenizer /m" in joined


def test_report_renders_the_accuracy_file(tmp_path: Path) -> None:
    summary = summarize(RECORDS)
    data = {"provenance": {"command": "python -m benchmark.accuracy.run_modes", "commit": "c1", "machine": "m"},
            "rows": summary["rows"], "agreement": summary["agreement"], "skipped_modes": {}}
    area = next(a for a in AREAS if a.key == "accuracy")
    section = build_section(area, tmp_path / "accuracy_modes.json", data, tmp_path, tmp_path / "fig")
    text = render_section(section)
    assert "| lynx-int8 | needle_single | 1024 | 0.250 | 0.250 | 0.000 | 0.500 | 2 | 4 | 1 |" in text
    assert "Output-token agreement with bf16" in text and (tmp_path / "fig" / "accuracy.png").exists()


def test_aggregate_only_reads_left_records_and_reports_missing_modes(tmp_path: Path) -> None:
    for mode, records in RECORDS.items():
        (tmp_path / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--aggregate-only", "--modes", "bf16", "lynx-int8", "lynx", "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "accuracy_modes.json").read_text())
    assert {r["mode"] for r in result["rows"]} == {"bf16", "lynx-int8"}
    assert "lynx" in result["skipped_modes"]
    assert "python -m benchmark.accuracy.run_modes --aggregate-only" in result["provenance"]["command"]
    assert (tmp_path / "accuracy_vs_context.png").exists()


def test_merge_keeps_modes_not_redone_with_their_provenance(tmp_path: Path) -> None:
    for mode, records in RECORDS.items():
        (tmp_path / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--aggregate-only", "--modes", "bf16", "--out", str(tmp_path)]) == 0
    first = json.loads((tmp_path / "accuracy_modes.json").read_text())
    assert main(["--aggregate-only", "--merge", "--modes", "lynx-int8", "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "accuracy_modes.json").read_text())
    assert {r["mode"] for r in merged["rows"]} == {"bf16", "lynx-int8"} and len(merged["agreement"]) == 1
    assert merged["earlier_provenance"] == [first["provenance"]]
    assert merged["mode_run_utc"]["bf16"] == first["provenance"]["time_utc"]
    area = next(a for a in AREAS if a.key == "accuracy")
    text = render_section(build_section(area, tmp_path / "accuracy_modes.json", merged, tmp_path, None))
    assert "- modes from an earlier run: machine:" in text
