"""The TTkT benchmark's tables and plots are pure functions of its rows."""

from __future__ import annotations

from benchmark.serving.ttkt_report import floors_from, headline, markdown, plot_bars, plot_timeline, summarize


def _row(mode: str, ratio: float, t1: float, t32: float | None, seed: int = 0, error: str = "") -> dict:
    times = [t1 + 0.1 * i for i in range(64)]
    return {"mode": mode, "context": 1024, "ratio": ratio, "link_gbps": 0.5, "seed": seed, "error": error,
            "found": True, "token_times": times, "tt1t": t1, "tt8t": times[7], "tt32t": t32, "tt64t": times[63],
            "lynx_drafts": 10 if mode == "lynx" else None, "lynx_accepted": 8 if mode == "lynx" else None,
            "lynx_verify_s": 0.05, "lynx_anchor_landed_s": 0.2, "lynx_residual_landed_s": 1.0,
            "lynx_fallback": None}


def test_summary_takes_medians_over_good_requests_and_the_headline_ratios(tmp_path) -> None:
    rows = [_row("int4", 16, 1.0, 4.0), _row("int8", 16, 2.0, 6.0), _row("lynx", 16, 1.0, 3.0),
            _row("lynx", 16, 2.0, 5.0, seed=1), _row("lynx", 16, 9.0, 9.0, seed=2, error="boom")]
    table = summarize(rows)
    lynx = next(e for e in table if e["mode"] == "lynx")
    assert lynx["n"] == 3 and lynx["errors"] == 1  # the failed request is counted, not averaged
    assert lynx["tt1t"] == 1.5 and lynx["tt32t"] == 4.0 and lynx["lynx_drafts"] == 10
    (h,) = headline(table)
    assert h["tt1t_lynx_over_int4"] == 1.5 and h["tt32t_int8_over_lynx"] == 1.5
    assert h["tt1t_int8_over_lynx"] == 2.0 / 1.5 and h["tt1t_raw_over_lynx"] is None
    assert h["lynx_never_later_than_int8"] is True
    text = markdown(table, {"provenance": None, "link": "pacer", "calibration": {"1024": {"prompt_tokens": 1100,
                                                                                            "step_s": 0.03}}})
    assert "| lynx | 1024 | 16 |" in text and "step 30.0 ms" in text
    assert "| 1024 | 16 | 1.33 | - | 1.50 | yes | 1.50 |" in text
    plot_bars(table, tmp_path / "bars.png")
    plot_timeline(rows, tmp_path / "timeline.png")
    assert (tmp_path / "bars.png").stat().st_size > 1000 and (tmp_path / "timeline.png").stat().st_size > 1000


def test_headline_is_empty_where_a_mode_is_missing() -> None:
    (h,) = headline(summarize([_row("lynx", 4, 1.0, 3.0)]))
    assert h["tt1t_lynx_over_int4"] is None and h["tt32t_int8_over_lynx"] is None
    assert h["tt1t_int8_over_lynx"] is None and h["lynx_never_later_than_int8"] is None
    (h,) = headline(summarize([_row("lynx", 16, 1.0, 3.0), _row("int8", 16, 2.0, 2.9)]))
    assert h["lynx_never_later_than_int8"] is False  # later at k = 32 only


def test_lynx_fields_take_the_current_value_of_a_per_token_list() -> None:
    from benchmark.serving.bench_ttkt import last_value

    assert last_value([0, 3, 3, 9]) == 9 and last_value(4) == 4 and last_value([]) == [] and last_value(None) is None


def test_each_mode_counts_the_prompts_whose_text_equals_raws() -> None:
    rows = [{**_row("raw", 16, 2.0, 6.0, seed=s), "text": f"answer {s}"} for s in range(3)]
    rows += [{**_row("lynx-exact", 16, 1.0, 5.0, seed=s), "text": f"answer {s}"} for s in range(3)]
    rows += [{**_row("lynx", 16, 1.0, 5.0, seed=s), "text": "answer 0" if s == 0 else "other"} for s in range(3)]
    rows += [_row("int8", 16, 1.0, 5.0)]  # a row from before texts were recorded
    by_mode = {e["mode"]: e for e in summarize(rows)}
    assert by_mode["lynx-exact"]["same_as_raw"] == 3 and by_mode["lynx"]["same_as_raw"] == 1
    assert by_mode["int8"]["same_as_raw"] is None and by_mode["raw"]["same_as_raw"] == 3
    assert summarize([_row("lynx", 4, 1.0, 3.0)])[0]["same_as_raw"] is None  # no raw in the run


def test_the_prefill_floor_bounds_the_tt1t_ratios_where_the_run_measured_it() -> None:
    table = summarize([_row("raw", 16, 3.0, 6.0), _row("int8", 16, 2.0, 6.0), _row("lynx", 16, 1.5, 5.0)])
    meta = {"provenance": None, "link": "shaped",
            "calibration": {"1024": {"prompt_tokens": 1100, "step_s": 0.03, "tt1t_floor_s": 1.25}}}
    assert floors_from(meta) == {1024: 1.25} and floors_from({"calibration": {"1024": {"step_s": 0.03}}}) == {}
    (h,) = headline(table, floors_from(meta))
    assert h["tt1t_floor_s"] == 1.25 and h["tt1t_int8_over_floor"] == 1.6 and h["tt1t_raw_over_floor"] == 2.4
    text = markdown(table, meta)
    assert "TT1T floor 1.25 s" in text and "bound: TT1T(int8) / floor" in text
    assert "| 1024 | 16 | 1.33 | 2.00 | 1.20 | yes | - | 1.25 | 1.60 | 2.40 |" in text
    (old,) = headline(table)  # a run from before the floor was recorded: no bound, the old table
    assert old["tt1t_floor_s"] is None and "bound:" not in markdown(table, {"calibration": {}})


def test_a_mode_variant_is_the_mode_with_one_setting_changed() -> None:
    import json

    import pytest
    from benchmark.pd_modes import lynx_config_arg, mode_server_args

    assert lynx_config_arg("lynx") == "lynx" and mode_server_args("raw") == []
    assert json.loads(lynx_config_arg("lynx~chunks")) == {"mode": "lynx", "stream_layer_group": 0}
    assert json.loads(lynx_config_arg("lynx-exact~layers=10")) == {"mode": "lynx-exact", "stream_layer_group": 10}
    for bad in ("lynx~layers=x", "lynx~nothing"):
        with pytest.raises(ValueError, match="layers=N"):
            lynx_config_arg(bad)
    assert mode_server_args("raw~no-overlap", ["--x"]) == ["--x", "--disable-overlap-schedule"]
    assert mode_server_args("lynx~no-overlap") == ["--disable-overlap-schedule", "--lynx", "--lynx-config", "lynx"]
    with pytest.raises(ValueError, match="server variants"):
        mode_server_args("raw~chunks")


def test_the_share_of_the_first_tokens_transfer_the_prefill_hid() -> None:
    from benchmark.model_shape import DEFAULT_KV
    from benchmark.serving.ttkt_report import first_token_bytes, hidden_lines

    raw_bytes = 1100 * 30 * 2 * 3 * 64 * 2  # the BF16 KV of 1,100 tokens of the default model
    assert first_token_bytes("raw", 1100, DEFAULT_KV) == raw_bytes
    assert first_token_bytes("raw~no-overlap", 1100, DEFAULT_KV) == raw_bytes
    lynx, int8 = first_token_bytes("lynx", 1100, DEFAULT_KV), first_token_bytes("int8", 1100, DEFAULT_KV)
    assert 0.25 * raw_bytes < lynx < 0.32 * raw_bytes < int8 < 0.55 * raw_bytes  # anchor ~4.7 bits, int8 8.5
    assert first_token_bytes("lynx~layers=3", 1100, DEFAULT_KV) == lynx  # a variant moves the same anchor
    assert first_token_bytes("lynx-exact", 1100, DEFAULT_KV) == lynx  # drafts on the same anchor
    lynx_int8 = first_token_bytes("lynx-int8", 1100, DEFAULT_KV)  # no drafting: waits for anchor and residual
    assert int8 < lynx_int8 < int8 * 1.005  # 8.5 bits + the sink token's exact copy (BENCHMARKS: 8.52 at 1K)
    assert first_token_bytes("lynx-int4", 1100, DEFAULT_KV) == lynx
    rows = [{**_row("raw", 16, 3.0, 6.0), "link_gbps": 0.05}, {**_row("lynx", 16, 1.5, 5.0), "link_gbps": 0.05}]
    meta = {"provenance": None, "link": "shaped", "kv_shape": {"layers": 30, "kv_heads": 3, "head_dim": 64},
            "calibration": {"1024": {"prompt_tokens": 1100, "step_s": 0.03, "tt1t_floor_s": 1.25}}}
    lines = hidden_lines(summarize(rows), meta)
    raw_s = raw_bytes * 8 / 0.05e9  # 4.06 s alone; TT1T came 1.75 s after the floor: 57% hidden
    assert lines[2] == f"| raw | 1024 | 16 | {raw_bytes / 1e6:.2f} | {raw_s:.2f} | 1.75 | {1 - 1.75 / raw_s:.0%} |"
    assert lines[3].startswith("| lynx | 1024 | 16 |")
    assert "How much of the first token" in markdown(summarize(rows), meta)
    assert hidden_lines(summarize(rows), {**meta, "kv_shape": None}) == []  # older runs: no table


def test_the_raw_ratios_take_the_earlier_stock_configuration_that_ran() -> None:
    rows = [_row("raw", 64, 4.0, 8.0), _row("raw~no-overlap", 64, 3.0, 9.0), _row("lynx", 64, 1.5, 5.0)]
    (h,) = headline(summarize(rows), {1024: 1.2})
    assert h["tt1t_raw_over_lynx"] == 2.0 and h["tt1t_raw_over_floor"] == 2.5  # no-overlap's 3.0 s
    (only,) = headline(summarize(rows[:1] + rows[2:]))
    assert only["tt1t_raw_over_lynx"] == 4.0 / 1.5


def test_a_stopped_run_writes_what_it_measured_and_says_so(tmp_path) -> None:
    import json

    from benchmark.serving.bench_ttkt import write_results

    meta = {"calibration": {"1024": {"prompt_tokens": 1100, "step_s": 0.03, "tt1t_floor_s": 0.9}}, "link": "pacer"}
    rows = [_row("int8", 16, 2.0, 6.0), _row("lynx", 16, 1.0, 3.0)]
    write_results(tmp_path, rows, meta, stopped="stopped (signal 15) after 2 requests")
    data = json.loads((tmp_path / "ttkt.json").read_text())
    assert data["stopped"] == "stopped (signal 15) after 2 requests" and len(data["rows"]) == 2
    assert [e["mode"] for e in data["table"]] == ["int8", "lynx"] and data["calibration"] == meta["calibration"]
    assert (tmp_path / "ttkt.md").read_text().startswith("**stopped (signal 15) after 2 requests")
    assert (tmp_path / "ttkt-bars.png").exists()
    write_results(tmp_path, rows, meta)  # a finished run: no such field, no such line
    assert "stopped" not in json.loads((tmp_path / "ttkt.json").read_text())
    assert not (tmp_path / "ttkt.md").read_text().startswith("**")
