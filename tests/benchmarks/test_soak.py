"""The pure parts of the load soak: outcome classification, the summary, the idle check, the plan, the
resource flatness rule, the restart phases, the config merge (no server)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from benchmark.reliability.outcomes import Result, classify, merge_config, plan, summarize, verdict
from benchmark.reliability.report import markdown
from benchmark.reliability.restart import phase_of
from benchmark.reliability.sampling import flatness, group_stats, resource_summary, segments

from sglang_lynx.launch.server_state import idle_problems

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
    assert s["failure_examples"] == ["ordinary/-/-: why"] * 2  # the wrong one and the lost one
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


# ----------------------------------------------------------------------------- space, restart phases, config

def test_space_refusals_are_their_own_failure() -> None:
    err = {"error": {"message": "sglang-lynx: send arena full: staging arena (33554432 bytes) has no free region"}}
    assert classify(_r("ordinary", 500, err), REFS)[0] == "no_space"
    assert classify(_r("fault_anchor", 500, err, fault="corrupt_anchor"), REFS)[0] == "no_space"
    assert classify(_r("ordinary", 500, err, phase="in_flight"), REFS)[0] == "no_space"
    waited = {"error": {"message": "Lynx staging: waited 30 s (transfer_timeout_s) for staging: the decode's "
                                   "receive arena (receive_arena_mb, 33554432 bytes) stayed full"}}
    assert classify(_r("fault_residual", 500, waited, fault="corrupt_residual"), REFS)[0] == "no_space"
    s = summarize([Result("ordinary", 0, 1.0, 500, err, outcome="no_space", reason="full")])
    assert s["no_space"] == 1 and verdict(s, True, True, True) == "FAIL"


def test_requests_in_flight_at_the_kill_may_fail_clearly_but_not_be_wrong() -> None:
    err = {"error": {"message": "Lost connection with prefill instance"}}
    assert classify(_r("ordinary", 500, err, phase="in_flight"), REFS)[0] == "clear_error"
    assert classify(_r("fault_residual", 502, "bad gateway", phase="in_flight", fault="corrupt_residual"),
                    REFS)[0] == "clear_error"
    assert classify(_r("ordinary", 200, _answer([1, 2, 3]), phase="in_flight"), REFS)[0] == "correct"
    assert classify(_r("ordinary", 200, _answer([7]), phase="in_flight"), REFS)[0] == "wrong"
    assert classify(_r("ordinary", None, "timed out", timed_out=True, phase="in_flight"), REFS)[0] == "lost"
    # after the restart (and before it) an error is an error
    assert classify(_r("ordinary", 500, err, phase="after"), REFS)[0] == "wrong"
    assert classify(_r("ordinary", 500, err, phase="before"), REFS)[0] == "wrong"


def test_phase_of_a_request_against_the_restart() -> None:
    assert phase_of(1.0, 5.0, None, None, planned=False) == "-"
    assert phase_of(1.0, 5.0, None, None, planned=True) == "before"
    assert phase_of(1.0, 5.0, 10.0, 70.0, planned=True) == "before"
    assert phase_of(8.0, 12.0, 10.0, None, planned=True) == "in_flight"
    assert phase_of(8.0, 80.0, 10.0, 70.0, planned=True) == "in_flight"
    assert phase_of(30.0, 80.0, 10.0, 70.0, planned=True) == "in_flight"  # slipped past the gate: not "after"
    assert phase_of(71.0, 80.0, 10.0, 70.0, planned=True) == "after"


def test_summary_counts_per_phase() -> None:
    rows = [Result("ordinary", 0, 1.0, 200, None, outcome=o, phase=ph)
            for o, ph in [("correct", "before"), ("clear_error", "in_flight"), ("correct", "after"),
                          ("correct", "after")]]
    s = summarize(rows)
    assert s["by_phase"]["before"]["correct"] == 1 and s["by_phase"]["in_flight"]["clear_error"] == 1
    assert s["by_phase"]["after"]["requests"] == 2 and "-" not in s["by_phase"]
    assert verdict(s, True, True, True) == "pass"
    assert verdict(s, True, True, False) == "FAIL" and verdict(s, True, False, True) == "FAIL"
    assert verdict(s, False, True, True) == "FAIL"


def test_config_overrides_keep_only_fields_the_config_knows() -> None:
    base = {"mode": "lynx", "transfer_timeout_s": 30.0}
    known = {"mode", "transfer_timeout_s", "residual_timeout_s"}
    assert merge_config(base, None, known) == (base, [])
    merged, dropped = merge_config(base, '{"residual_timeout_s": 4, "staging_mb": 32}', known)
    assert merged == {**base, "residual_timeout_s": 4} and dropped == ["staging_mb"]
    with pytest.raises(ValueError, match="JSON object"):
        merge_config(base, "[1]", known)


# ----------------------------------------------------------------------------- resources: flatness

def _rows(server: str, values: list[tuple[int, float, int, int]], t0: float = 0.0,
          end: bool = True) -> list[dict[str, Any]]:
    """Sample rows every 10 s: (pgid, rss, sockets, threads) per row; the last one labelled ``end``."""
    rows = [{"t": t0 + 10.0 * i, "label": "during",
             server: {"pgid": g, "processes": 3, "rss_mib": r, "sockets": s, "threads": th}}
            for i, (g, r, s, th) in enumerate(values)]
    if end:
        rows[-1]["label"] = "end"
    return rows


def test_flat_within_tolerance_and_growth_beyond_it() -> None:
    # warm-up: first 20 % of 0..90 s = samples at 0, 10 (max 1010); end 1030 <= 1010 * 1.02 = 1030.2
    pts = segments(_rows("d", [(7, 1000, 10, 40), (7, 1010, 12, 41)] + [(7, 1020, 12, 41)] * 7
                          + [(7, 1030, 14, 43)]), "d")[0]
    rss, sock, thr = (flatness(pts, q) for q in ("rss_mib", "sockets", "threads"))
    assert rss["warmup"] == 1010 and rss["start"] == 1000 and rss["end"] == 1030 and rss["verdict"] == "flat"
    assert sock["warmup"] == 12 and sock["verdict"] == "flat" and thr["verdict"] == "flat"
    assert flatness(pts, "rss_mib", rss_rel_tol=0.01)["verdict"] == "GREW"
    assert flatness(pts, "sockets", count_tol=1)["verdict"] == "GREW"
    assert rss["max"] == 1030 and rss["warmup_until_s"] == 18.0


def test_a_drop_at_the_end_is_flat_and_short_runs_are_not() -> None:
    pts = segments(_rows("p", [(5, 2000, 20, 50)] * 4 + [(5, 1500, 8, 30)]), "p")[0]
    assert all(flatness(pts, q)["verdict"] == "flat" for q in ("rss_mib", "sockets", "threads"))
    assert flatness(pts[:1], "rss_mib")["verdict"] == "too short"
    assert flatness([], "rss_mib")["verdict"] == "no samples"


def test_a_restart_starts_a_new_segment_and_the_last_one_is_judged() -> None:
    old = _rows("prefill", [(5, 4000, 30, 80)] * 3, end=False)
    gap = [{"t": 30.0, "label": "during", "prefill": {"pgid": 5, "processes": 0, "rss_mib": 0, "sockets": 0,
                                                          "threads": 0}}]  # killed: nothing to read
    new = _rows("prefill", [(9, 3000, 20, 70)] * 4 + [(9, 3010, 21, 70)], t0=40.0)
    samples = old + gap + new
    segs = segments(samples, "prefill")
    assert [len(s) for s in segs] == [3, 5] and segs[1][0]["pgid"] == 9
    res = resource_summary(samples, ("prefill",))
    assert res["prefill"]["segments"] == 2 and res["prefill"]["judged_from_t"] == 40.0
    assert res["prefill"]["rss_mib"]["start"] == 3000 and res["prefill"]["flat"] and res["all_flat"]
    grown = new[:-1] + _rows("prefill", [(9, 3500, 21, 70)], t0=80.0)
    assert not resource_summary(old + grown, ("prefill",))["all_flat"]
    # the new prefill died before the end: its last reading is not an end value
    died = resource_summary(old + gap + new[:-1], ("prefill",))["prefill"]
    assert died["rss_mib"]["verdict"] == "no end sample" and not died["flat"]
    text = markdown({"summary": summarize([]), "resources": res, "verdict": "pass"})
    assert "| prefill (after restart) | RSS MiB | 3000 | 3000 | 3010 | 3010 | 3060.0 (+2%) | flat |" in text


def test_group_stats_reads_a_process_group_from_proc(tmp_path: Path) -> None:
    def proc(pid: int, pgid: int, rss_kib: int, fds: list[str], threads: int) -> None:
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "task").mkdir()
        (d / "stat").write_text(f"{pid} (python3 (x)) S 1 {pgid} {pgid} 0 -1")
        (d / "status").write_text(f"Name:\tpython3\nVmRSS:\t  {rss_kib} kB\n")
        for i, target in enumerate(fds):
            os.symlink(target, d / "fd" / str(i))
        for t in range(threads):
            (d / "task" / str(pid + t)).mkdir()

    proc(100, 100, 2048, ["socket:[1]", "/dev/null", "socket:[2]"], 3)
    proc(101, 100, 1024, ["pipe:[5]", "socket:[3]"], 2)
    proc(200, 200, 4096, ["socket:[9]"], 1)
    (tmp_path / "self").mkdir()
    got = group_stats(100, tmp_path)
    assert got == {"pgid": 100, "processes": 2, "rss_mib": 3.0, "sockets": 3, "threads": 5}
    assert group_stats(999, tmp_path)["processes"] == 0
