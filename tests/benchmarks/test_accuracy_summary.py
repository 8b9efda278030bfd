"""Per-mode accuracy summary (benchmark/accuracy/summary.py): seed spread over tasks, delta, identical outputs."""

from __future__ import annotations

from typing import Any

import pytest
from benchmark.accuracy.aggregate import accuracy_rows
from benchmark.accuracy.summary import common_tasks, identical_counts, mode_summaries


def rec(mode: str, task: str, seed: int, depth: float, score: float, tokens: list[int], context: int = 1024,
        status: str = "ok", kind: str = "ids") -> dict[str, Any]:
    return {"mode": mode, "task": task, "context_tokens_target": context, "seed": seed, "score": score,
            "status": status, "instance_id": f"{task}/{context}/{seed}/{depth}", "token_kind": kind,
            "output_tokens": tokens}


# bf16: needle_single (two depths) and needle_multi (one instance) per seed.
# seed 0: single (1 + 0) / 2 = 0.5, multi 1 -> 0.75; seed 1: single 1, multi 0 -> 0.5.
BF16 = [rec("bf16", "needle_single", 0, 0.0, 1.0, [1]), rec("bf16", "needle_single", 0, 1.0, 0.0, [2]),
        rec("bf16", "needle_multi", 0, 0.5, 1.0, [3]),
        rec("bf16", "needle_single", 1, 0.0, 1.0, [4]), rec("bf16", "needle_single", 1, 1.0, 1.0, [5]),
        rec("bf16", "needle_multi", 1, 0.5, 0.0, [6])]
# int8: identical tokens on 2 instances, one timed out (not compared, scores 0, counted as an error).
# seed 0: single (1 + 1) / 2 = 1, multi 0 -> 0.5; seed 1: single (0 + 1) / 2 = 0.5, multi 0 -> 0.25.
INT8 = [rec("int8", "needle_single", 0, 0.0, 1.0, [1]), rec("int8", "needle_single", 0, 1.0, 1.0, [9]),
        rec("int8", "needle_multi", 0, 0.5, 0.0, [3]),
        rec("int8", "needle_single", 1, 0.0, 0.0, [], status="timeout"),
        rec("int8", "needle_single", 1, 1.0, 1.0, [7]), rec("int8", "needle_multi", 1, 0.5, 0.0, [8])]


def by_mode(rows: list[Any]) -> dict[tuple[str, int], Any]:
    return {(r.mode, r.context_tokens): r for r in rows}


def test_tasks_weigh_the_same_and_the_spread_is_across_seeds() -> None:
    row = by_mode(mode_summaries(BF16))[("bf16", 1024)]
    # an instance mean would give seed 0 2/3; every task weighs the same, so seed 0 scores 0.75
    assert (row.mean, row.std, row.minimum, row.maximum) == pytest.approx((0.625, 0.125, 0.5, 0.75))
    assert (row.seeds, row.instances, row.errors, row.tasks) == (2, 6, 0, ("needle_multi", "needle_single"))
    assert row.delta_points is None and row.identical is None  # the reference has no delta
    per_task = statistics_of_rows(BF16)
    assert row.mean == pytest.approx(sum(per_task) / len(per_task))  # = mean of the per-task rows


def statistics_of_rows(records: list[dict[str, Any]]) -> list[float]:
    return [r.mean for r in accuracy_rows(records)]


def test_delta_in_points_and_identical_outputs_against_bf16() -> None:
    row = by_mode(mode_summaries(BF16 + INT8))[("int8", 1024)]
    assert row.mean == pytest.approx(0.375) and row.std == pytest.approx(0.125)
    assert row.delta_points == pytest.approx(-25.0)
    assert (row.identical, row.matched, row.errors) == (2, 5, 1)  # the timed-out request is not compared


def test_delta_is_taken_at_the_same_context_and_missing_reference_gives_none() -> None:
    at_2k = [rec("int8", "needle_single", 0, 0.0, 1.0, [1], context=2048),
             rec("int8", "needle_multi", 0, 0.5, 1.0, [3], context=2048)]
    rows = by_mode(mode_summaries(BF16 + INT8 + at_2k))
    assert rows[("int8", 1024)].delta_points == pytest.approx(-25.0)
    assert rows[("int8", 2048)].mean == 1.0 and rows[("int8", 2048)].delta_points is None
    assert [(r.mode, r.context_tokens) for r in mode_summaries(BF16 + INT8 + at_2k)] == [
        ("bf16", 1024), ("int8", 1024), ("int8", 2048)]


def test_tasks_missing_from_some_cell_are_left_out() -> None:
    extra = [rec("bf16", "kv_retrieval", 0, 0.0, 0.0, [1]), rec("bf16", "kv_retrieval", 1, 0.0, 0.0, [1])]
    assert common_tasks(BF16 + INT8 + extra) == ("needle_multi", "needle_single")
    rows = by_mode(mode_summaries(BF16 + INT8 + extra))
    assert rows[("bf16", 1024)].mean == pytest.approx(0.625) and rows[("bf16", 1024)].instances == 6
    with pytest.raises(ValueError, match="lacks task"):  # asked for explicitly, int8 does not have it
        mode_summaries(BF16 + INT8 + extra, tasks=["kv_retrieval", "needle_single"])


def test_what_cannot_be_summarized_honestly_raises() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        mode_summaries(BF16 + BF16[:1])
    with pytest.raises(ValueError, match="seed 1 lacks task"):
        mode_summaries([r for r in BF16 if not (r["seed"] == 1 and r["task"] == "needle_multi")],
                       tasks=["needle_multi", "needle_single"])
    with pytest.raises(ValueError, match="no task is present"):
        mode_summaries([rec("bf16", "needle_single", 0, 0.0, 1.0, [1]),
                        rec("int8", "needle_multi", 0, 0.5, 1.0, [1])])
    with pytest.raises(ValueError, match="token kinds differ"):
        mode_summaries(BF16 + [{**r, "token_kind": "strings"} for r in INT8])


def test_identical_counts_per_candidate_cell() -> None:
    lynx = [{**r, "mode": "lynx"} for r in BF16]
    lynx[0] = {**lynx[0], "output_tokens": [0]}
    assert identical_counts(BF16, lynx) == {("lynx", 1024): (5, 6)}
    assert identical_counts([], lynx) == {}
