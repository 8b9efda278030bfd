"""bench_serving JSONL parsing and the sweep table (fixtures shaped like bench_serving's output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark.serving.bench_serving_sweep import write_local_sharegpt
from benchmark.serving.serving_results import failed_run, last_run, merge_rows, parse_run, read_jsonl, sweep_table

RUN = {"backend": "sglang", "dataset_name": "random", "request_rate": 0.4, "completed": 3, "duration": 30.5,
       "request_throughput": 0.098, "input_throughput": 90.1, "output_throughput": 3.1, "mean_ttft_ms": 2500.0,
       "median_ttft_ms": 2400.0, "p99_ttft_ms": 4000.0, "mean_itl_ms": 95.0, "median_itl_ms": 90.0,
       "p99_itl_ms": 130.0, "mean_tpot_ms": 96.0, "median_tpot_ms": 94.0, "p99_tpot_ms": 110.0,
       "mean_e2e_latency_ms": 5500.0, "total_input_tokens": 2700, "total_output_tokens": 96, "concurrency": 1.4,
       "input_lens": [900, 1000, 800, 1024], "errors": ["", "", "", "ClientConnectorError: refused"]}


def test_parse_run_keeps_metrics_and_counts_failed_requests() -> None:
    row = parse_run(RUN, "int8", num_prompts=4)
    assert (row["mode"], row["request_rate"], row["completed"]) == ("int8", 0.4, 3.0)
    assert row["mean_ttft_ms"] == 2500.0 and row["mean_tpot_ms"] == 96.0 and row["output_throughput"] == 3.1
    assert row["failed_requests"] == 1 and "refused" in row["first_error"]
    assert row["mean_input_len"] == pytest.approx(931.0)


def test_infinite_rate_and_missing_metrics(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({**RUN, "request_rate": float("inf"), "mean_itl_ms": None}) + "\n")
    row = last_run(path, "lynx", float("inf"), 4)
    assert row["request_rate"] == float("inf") and row["mean_itl_ms"] is None


def test_no_output_line_is_a_failed_run_not_zeros(tmp_path: Path) -> None:
    row = last_run(tmp_path / "absent.jsonl", "lynx", 0.1, 4, "bench_serving exited 1")
    assert row["completed"] is None and row["failed_requests"] == 4 and row["error"] == "bench_serving exited 1"
    table = sweep_table([row])
    assert "| lynx | 0.100 | - | 4 |" in table and "bench_serving exited 1" in table


def test_last_line_wins_and_bad_lines_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({**RUN, "completed": 1}) + "\n" + json.dumps(RUN) + "\n")
    assert last_run(path, "m", 0.4, 4)["completed"] == 3.0
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="run.jsonl:1"):
        read_jsonl(path)


def test_sweep_table_row() -> None:
    table = sweep_table([parse_run(RUN, "int8", 4)])
    expected = "| int8 | 0.400 | 3/4 | 1 | 931 | 2500.0 | 4000.0 | 95.0 | 130.0 | 96.0 | 3.10 | 0.098 | 1.40 | - | - |"
    assert expected in table


def test_local_dataset_is_sharegpt_shaped(tmp_path: Path) -> None:
    data = json.loads(write_local_sharegpt(tmp_path / "d.json", conversations=3, words=50).read_text())
    assert len(data) == 3
    for item in data:
        turns = item["conversations"]
        assert len(turns) >= 2 and turns[0]["from"] == "human" and len(turns[0]["value"].split()) >= 50


def test_merge_replaces_redone_runs_and_keeps_the_rest() -> None:
    old = [parse_run(RUN, "int8", 4) | {"run_utc": "t0"}, failed_run("lynx-int8", 0.4, 4, "killed") | {"run_utc": "t0"}]
    new = [parse_run(RUN, "lynx-int8", 4) | {"run_utc": "t1"}, parse_run(RUN, "lynx", 4) | {"run_utc": "t1"}]
    merged = merge_rows(old, new)
    assert [(r["mode"], r["run_utc"], r["error"]) for r in merged] == [
        ("int8", "t0", ""), ("lynx-int8", "t1", ""), ("lynx", "t1", "")]
