"""``benchmark/serving/trace_report.py``: a request's timeline from trace events, on hand-made events."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark.serving.trace_report import cell_medians, load_events, match_rows, request_summary


def _events(base: float) -> list[dict]:
    def done(kind: str, n: int, issue: float, end: float) -> dict:
        return {"t": base + end, "ev": "done", "rid": "7", "kind": kind, "bytes": n, "wire_s": end - issue}

    return [
        {"t": base + 0.5, "ev": "forward_begin", "rid": "7"},
        {"t": base + 0.6, "ev": "encode", "rid": "7", "dur": 0.01, "final": False},
        done("anchor", 1000, 0.6, 0.8),
        done("residual", 4000, 0.8, 1.5),  # done before the forward ended
        done("residual", 3000, 1.9, 2.6),  # on the wire when the last anchor went out
        {"t": base + 2.0, "ev": "forward_end", "rid": "7"},
        {"t": base + 2.1, "ev": "encode", "rid": "7", "dur": 0.02, "final": True},
        done("anchor", 500, 2.1, 2.4),
        {"t": base + 2.41, "ev": "land", "rid": "7", "kind": "anchor"},
        {"t": base + 2.45, "ev": "recv_land", "rid": "7", "kind": "anchor"},
        {"t": base + 2.5, "ev": "admit", "rid": "7"},
    ]


def test_a_request_timeline_from_the_client_send(tmp_path: Path) -> None:
    base = 1000.0
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    shuffled = _events(base)[::-1]
    (trace_dir / "lynx-trace-1.jsonl").write_text("\n".join(json.dumps(e) for e in shuffled) + "\n{cut")
    events = load_events(trace_dir)
    assert [e["t"] for e in events] == sorted(e["t"] for e in events) and len(events) == 11
    rows = [{"sent_at": base - 50.0, "tt1t": 9.0}, {"sent_at": base, "tt1t": 2.6}, {"sent_at": base + 5.0}]
    matched = match_rows({"7": events, "8": [{"t": base + 3.0, "ev": "forward_begin", "rid": "8"}]}, rows)
    assert matched["7"]["sent_at"] == base
    assert "8" not in matched  # after the row's first token: another request (a calibration's), not this row's
    s = request_summary(events, base, 2.6)
    assert abs(s["fwd1"] - 2.0) < 1e-9 and abs(s["a_last_issue"] - 2.1) < 1e-9 and abs(s["a_last_done"] - 2.4) < 1e-9
    assert abs(s["recv"] - 2.45) < 1e-9 and abs(s["admit"] - 2.5) < 1e-9
    assert s["a_after_fwd"] == 500 and s["r_before_fwd"] == 4000 and s["r_in_flight"] == 3000
    assert s["anchor_chunks"] == 2 and s["residual_chunks"] == 2 and s["encode_s"] == 0.03


def test_cell_medians_group_the_matched_requests_by_context_and_ratio() -> None:
    def summary(fwd1: float, tt1t: float | None) -> dict:
        return {"fwd1": fwd1, "recv": fwd1 + 0.1, "tt1t": tt1t, "a_after_fwd": 1e6, "r_before_fwd": 0}

    pairs = [(summary(3.0, 3.2), {"context": 1024, "ratio": 64}), (summary(3.4, 3.5), {"context": 1024, "ratio": 64}),
             (summary(3.2, 3.3), {"context": 1024, "ratio": 64}), (summary(3.0, 9.0), {"context": 1024, "ratio": 256}),
             (summary(3.0, None), {"context": 1024, "ratio": 256})]  # no first token: left out
    cells = cell_medians(pairs)
    assert [(c["ratio"], c["n"]) for c in cells] == [(256, 1), (64, 3)]
    by = {c["ratio"]: c for c in cells}
    assert abs(by[64]["fwd1"] - 3.2) < 1e-9 and abs(by[64]["tt1t"] - 3.3) < 1e-9
    assert abs(by[64]["tt1t_after_fwd"] - 0.1) < 1e-9 and abs(by[256]["tt1t_after_fwd"] - 6.0) < 1e-9
    assert by[64]["a_after_fwd"] == 1e6
