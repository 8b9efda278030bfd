"""The pure parts of the load soak: outcome classification, the summary, the idle check, the plan."""

from __future__ import annotations

from typing import Any

from benchmark.reliability.soak import Result, classify, idle_problems, markdown, plan, summarize

REFS = {"ordinary": [1, 2, 3], "recompute": [1, 2, 4]}


def _answer(ids: list[int], fallback: str | None = None, finish: str = "length") -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": {"type": finish}}
    if fallback is not None:
        meta["lynx_fallback"] = [fallback]
    return {"output_ids": ids, "meta_info": meta}


def _r(kind: str, status: int | None, body: Any, **kw: Any) -> Result:
    return Result(kind, 0, 1.0, status, body, **kw)


def test_greedy_answers_are_checked_against_the_path_they_took() -> None:
    assert classify(_r("ordinary", 200, _answer([1, 2, 3])), REFS)[0] == "correct"
    assert classify(_r("ordinary", 200, _answer([1, 2, 4])), REFS)[0] == "wrong"
    # a residual timeout under load: the recompute output is the right one
    assert classify(_r("ordinary", 200, _answer([1, 2, 4], "recompute: residual timeout")), REFS)[0] == "correct"
    assert classify(_r("ordinary", 200, _answer([1, 2, 3], "recompute: residual timeout")), REFS)[0] == "wrong"
    assert classify(_r("ordinary", 200, _answer([1, 2, 3])), None)[0] == "wrong"
    assert classify(_r("ordinary", 500, {"error": "boom"}), REFS)[0] == "wrong"
    assert classify(_r("ordinary", 200, _answer([1, 2], finish="abort")), REFS)[0] == "wrong"


def test_residual_faults_must_fall_back_and_name_the_fault() -> None:
    ok = _answer([1, 2, 4], "recompute: residual checksum mismatch")
    assert classify(_r("fault_residual", 200, ok, fault="corrupt_residual"), REFS)[0] == "correct"
    assert classify(_r("fault_residual", 200, ok, fault="wrong_size_residual"), REFS)[0] == "wrong"
    assert classify(_r("fault_residual", 200, _answer([1, 2, 3]), fault="corrupt_residual"), REFS)[0] == "wrong"
    bad = _answer([9], "recompute: residual checksum mismatch")
    assert classify(_r("fault_residual", 200, bad, fault="corrupt_residual"), REFS)[0] == "wrong"


def test_anchor_faults_must_give_a_clear_error() -> None:
    err = {"error": {"message": "lynx anchor checksum mismatch"}}
    assert classify(_r("fault_anchor", 500, err, fault="corrupt_anchor"), REFS)[0] == "clear_error"
    aborted = _answer([], finish="abort")
    aborted["meta_info"]["finish_reason"]["message"] = "anchor wrong size"
    assert classify(_r("fault_anchor", 200, aborted, fault="wrong_size_anchor"), REFS)[0] == "clear_error"
    assert classify(_r("fault_anchor", 500, {"error": "something"}, fault="corrupt_anchor"), REFS)[0] == "wrong"
    assert classify(_r("fault_anchor", 200, _answer([1, 2, 3]), fault="corrupt_anchor"), REFS)[0] == "wrong"


def test_lost_aborted_and_sampled() -> None:
    assert classify(_r("ordinary", None, "timed out", timed_out=True), REFS)[0] == "lost"
    assert classify(_r("fault_residual", None, "ConnectionResetError"), REFS)[0] == "lost"
    assert classify(_r("abort", None, "timed out", timed_out=True, abort_how="disconnect"), REFS)[0] == "lost"
    assert classify(_r("abort", 200, {"x": 1}, abort_how="disconnect"), REFS)[0] == "aborted"
    assert classify(_r("abort", 200, _answer([1], finish="abort"), abort_how="abort_request"), REFS)[0] == "aborted"
    # an abort that came after the end: the answer must still be right
    assert classify(_r("abort", 200, _answer([1, 2, 3]), abort_how="abort_request"), REFS)[0] == "correct"
    assert classify(_r("abort", 200, _answer([7]), abort_how="abort_request"), REFS)[0] == "wrong"
    assert classify(_r("sampled", 200, _answer([5, 6])), REFS)[0] == "correct"
    assert classify(_r("sampled", 200, _answer([])), REFS)[0] == "wrong"


def test_summary_counts_and_percentiles() -> None:
    results = []
    for i, outcome in enumerate(["correct"] * 8 + ["wrong", "lost"]):
        r = _r("ordinary", 200, None)
        r.seconds, r.outcome, r.reason = float(i + 1), outcome, "why"
        results.append(r)
    a = _r("abort", 200, None, abort_how="disconnect")
    a.outcome = "aborted"
    results.append(a)
    s = summarize(results)
    assert s["requests"] == 11 and s["lost"] == 1 and s["wrong"] == 1 and s["unclassified"] == 0
    row = s["by_kind"]["ordinary"]
    assert row["correct"] == 8 and row["requests"] == 10
    assert row["p50_s"] == 5.0  # 1..9 answered (lost excluded)
    assert s["by_kind"]["abort"]["aborted"] == 1 and s["by_kind"]["abort"]["p50_s"] is None
    assert s["wrong_examples"] == ["ordinary/-: why"]
    text = markdown({"summary": s, "memory": {}, "verdict": "FAIL"})
    assert "| ordinary | 10 | 8 |" in text and "**FAIL**" in text


def test_idle_problems() -> None:
    base = {"role": "decode", "registered_bytes": 100, "kv_pool_free_tokens": 50,
            "staging": {"free_bytes": 10, "arena_bytes": 10, "leases": 0}}
    assert idle_problems(base, base) == []
    assert idle_problems(None, base) == ["no lynx state"]
    leaked = {**base, "kv_pool_free_tokens": 40, "tracked_requests": 1,
              "staging": {"free_bytes": 5, "arena_bytes": 10, "leases": 1}}
    assert len(idle_problems(leaked, base)) == 3


def test_plan_is_seeded_and_follows_the_fractions() -> None:
    specs = plan(1000, 0.2, 0.1, 0.1, 3, seed=1)
    assert specs == plan(1000, 0.2, 0.1, 0.1, 3, seed=1)
    faults = sum(s["kind"].startswith("fault") for s in specs)
    assert 150 < faults < 250
    assert {s["prompt"] for s in specs} == {0, 1, 2}
    assert all(s["kind"] == "ordinary" for s in plan(50, 0.0, 0.0, 0.0, 2, seed=0))
