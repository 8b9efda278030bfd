"""The late decode pace: tokens 33-64 of requests whose verify released its tokens before token 33."""

from __future__ import annotations

import json

from benchmark.serving.token_pace import main, pace_cells
from benchmark.serving.ttkt_report import late_pace, summarize


def _row(mode: str, step: float, drafts: int | None = None, seed: int = 0, released_at: int = 0) -> dict:
    """64 token times: token 1 at 1 s, tokens 2..``released_at`` together (a verify), then one per ``step``."""
    times = [1.0]
    for i in range(2, 65):
        times.append(times[-1] if i <= released_at else times[-1] + step)
    return {"mode": mode, "context": 1024, "ratio": 64.0, "link_gbps": 0.5, "seed": seed, "error": "", "found": True,
            "token_times": times, "tt1t": 1.0, "tt8t": times[7], "tt32t": times[31], "tt64t": times[63],
            "lynx_drafts": drafts}


def test_late_pace_is_the_median_gap_of_tokens_33_to_64_past_the_verify() -> None:
    assert abs(late_pace(_row("lynx", 0.1, drafts=6, released_at=8)) - 0.1) < 1e-12
    times = _row("int8", 0.1)["token_times"]
    times[40] += 0.05  # one late token: the median ignores it
    assert abs(late_pace({"token_times": times}) - 0.1) < 1e-12
    # a verify that released tokens up to 32 is still outside the window; one reaching 33 is not
    assert late_pace(_row("lynx", 0.1, drafts=30, released_at=32)) is not None
    assert late_pace(_row("lynx", 0.1, drafts=31, released_at=33)) is None
    assert late_pace({"token_times": [1.0] * 63}) is None  # fewer than 64 tokens


def test_cells_compare_each_mode_with_int8_in_the_same_cell(tmp_path, capsys) -> None:
    rows = [_row("int8", 0.10), _row("int8", 0.12, seed=1), _row("lynx", 0.121, drafts=6, released_at=8),
            _row("lynx", 0.11, drafts=6, seed=1, released_at=8), _row("lynx", 0.5, drafts=63, seed=2, released_at=64)]
    rows.append({**_row("lynx", 9.0, seed=3), "error": "boom"})
    cells = {c["mode"]: c for c in pace_cells(rows)}
    assert cells["int8"]["n"] == 2 and abs(cells["int8"]["pace_s"] - 0.11) < 1e-9
    lynx = cells["lynx"]
    assert lynx["n"] == 2 and lynx["drafts_median"] == 6  # the 63-draft request has no late window; the error: dropped
    assert abs(lynx["pace_s"] - 0.1155) < 1e-9 and abs(lynx["over_int8"] - 0.1155 / 0.11) < 1e-9
    assert abs(summarize(rows)[1]["pace_late_s"] - 0.1155) < 1e-9  # the TTkT summary carries it too
    run = tmp_path / "run"
    run.mkdir()
    (run / "ttkt-rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pace.json"
    assert main([str(run), "--out", str(out)]) == 0
    assert "| lynx | 1024 | 64 | 2 | 6 | 115.5 (110.0-121.0) | 1.050 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"]["run"][1]["mode"] == "lynx"
