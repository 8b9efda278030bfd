"""Where a request's first-token time goes: read the servers' transfer traces (``bench_ttkt.py --trace``).

Usage::

    python benchmark/serving/trace_report.py OUT/trace/lynx [--rows OUT/ttkt-rows.jsonl] [--chunks]

Per request (matched to a benchmark row by time: the row sent last before the request's first event), in
seconds from the client's send (or from the request's first event when no row matches):

- ``fwd0`` / ``fwd1``: its layered forward's begin / end on the prefill;
- ``a_last_issue`` / ``a_last_done``: the last anchor chunk handed to the engine / finished (sender);
- ``a_land`` / ``recv``: the anchor landed (sender) / trusted by the decode side; ``admit``: admitted;
- ``tt1t``: the client's first token;
- ``a_after_fwd``: anchor bytes issued after the forward ended; ``r_before_fwd``: residual bytes done
  before it; ``r_in_flight``: residual bytes on the wire (issued, not done) when the last anchor chunk was
  issued: what the anchor shared the link with.

``--chunks`` also lists every chunk (kind, bytes, issue, done) of each request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_events(trace_dir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(trace_dir.glob("lynx-trace-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed server
                continue
    return sorted(events, key=lambda e: e["t"])


def chunks_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pair each ``done`` with its ``issue`` (done - wire_s)."""
    return [{"kind": e["kind"], "bytes": e["bytes"], "issue": e["t"] - e["wire_s"], "done": e["t"]}
            for e in events if e["ev"] == "done"]


def request_summary(events: list[dict[str, Any]], sent_at: float | None, tt1t: float | None) -> dict[str, Any]:
    base = sent_at if sent_at is not None else events[0]["t"]

    def first(ev: str, **match: Any) -> float | None:
        for e in events:
            if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
                return e["t"] - base
        return None

    def last(ev: str, **match: Any) -> float | None:
        times = [e["t"] for e in events if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]
        return max(times) - base if times else None

    chunks = [{**c, "issue": c["issue"] - base, "done": c["done"] - base} for c in chunks_of(events)]
    anchors = [c for c in chunks if c["kind"] == "anchor"]
    residuals = [c for c in chunks if c["kind"] == "residual"]
    fwd1 = last("forward_end")
    a_last = max(anchors, key=lambda c: c["issue"]) if anchors else None
    out: dict[str, Any] = {
        "fwd0": first("forward_begin"), "fwd1": fwd1,
        "a_last_issue": a_last["issue"] if a_last else None,
        "a_last_done": max(c["done"] for c in anchors) if anchors else None,
        "a_land": first("land", kind="anchor"), "recv": first("recv_land", kind="anchor"),
        "admit": first("admit"), "tt1t": tt1t,
        "r_land": first("land", kind="residual"),
        "anchor_chunks": len(anchors), "residual_chunks": len(residuals),
        "encode_s": round(sum(e.get("dur", 0.0) for e in events if e["ev"] == "encode"), 3),
    }
    if fwd1 is not None:
        out["a_after_fwd"] = sum(c["bytes"] for c in anchors if c["issue"] >= fwd1)
        out["r_before_fwd"] = sum(c["bytes"] for c in residuals if c["done"] <= fwd1)
    if a_last is not None:
        t = a_last["issue"]
        out["r_in_flight"] = sum(c["bytes"] for c in residuals if c["issue"] <= t < c["done"])
    out["chunks"] = chunks
    return out


def match_rows(rids: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    sent = sorted((r for r in rows if r.get("sent_at")), key=lambda r: r["sent_at"])
    matched = {}
    for rid, events in rids.items():
        t = events[0]["t"]
        # the request's first event comes before its first token (a calibration request sent after a row is not it)
        before = [r for r in sent if r["sent_at"] <= t <= r["sent_at"] + (r.get("tt1t") or 120)]
        if before:
            matched[rid] = before[-1]
    return matched


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int) and value > 10_000:
        return f"{value / 1e6:.2f}M"
    return str(value)


def cell_medians(summaries: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (context, ratio) of the matched rows: medians of the forward's end, the anchor (or one stream) trusted on
    the decode, the first token, the first token after the forward's end, and the bytes sent around it."""
    cells: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for summary, row in summaries:
        if summary["tt1t"] is not None and summary["fwd1"] is not None and summary["recv"] is not None:
            cells[(row.get("context"), row.get("ratio"))].append(summary)
    out = []
    for (context, ratio), group in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        def median(key: str, group: list[dict[str, Any]] = group) -> float:
            return float(statistics.median(s.get(key) or 0 for s in group))

        out.append({"context": context, "ratio": ratio, "n": len(group), "fwd1": median("fwd1"),
                    "recv": median("recv"), "tt1t": median("tt1t"),
                    "tt1t_after_fwd": float(statistics.median(s["tt1t"] - s["fwd1"] for s in group)),
                    "a_after_fwd": median("a_after_fwd"), "r_before_fwd": median("r_before_fwd")})
    return out


COLUMNS = ["fwd0", "fwd1", "a_last_issue", "a_last_done", "a_land", "recv", "admit", "tt1t", "r_land",
           "a_after_fwd", "r_before_fwd", "r_in_flight", "anchor_chunks", "residual_chunks", "encode_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--rows", type=Path, help="the run's ttkt-rows.jsonl (times from the client's send)")
    parser.add_argument("--chunks", action="store_true", help="list every chunk of each request")
    args = parser.parse_args()
    events = load_events(args.trace_dir)
    if not events:
        print(f"no trace events under {args.trace_dir}", file=sys.stderr)
        return 1
    by_rid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if "rid" in e:
            by_rid[str(e["rid"])].append(e)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()] if args.rows else []
    matched = match_rows(by_rid, rows)
    summaries, pairs = [], []
    print("| rid | " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for rid, evs in by_rid.items():
        row = matched.get(rid)
        s = request_summary(evs, row["sent_at"] if row else None, row.get("tt1t") if row else None)
        summaries.append(s)
        if row is not None:
            pairs.append((s, row))
        print(f"| {rid} | " + " | ".join(fmt(s.get(c)) for c in COLUMNS) + " |")
        if args.chunks:
            for c in s["chunks"]:
                print(f"    {c['kind']:8s} {c['bytes']:>9d} B  issue {c['issue']:.3f}  done {c['done']:.3f}")
    cells = cell_medians(pairs)
    if cells:
        print("\nMedians per cell (s from the client's send; MB: anchor sent after the forward, residual done "
              "before it)")
        print("| context | ratio | n | forward end | anchor trusted | TT1T | TT1T - forward end | anchor MB after | "
              "residual MB before |\n|---|---|---|---|---|---|---|---|---|")
        for c in cells:
            print(f"| {c['context']} | {c['ratio']:g} | {c['n']} | {c['fwd1']:.2f} | {c['recv']:.2f} | "
                  f"{c['tt1t']:.2f} | {c['tt1t_after_fwd']:.2f} | {c['a_after_fwd'] / 1e6:.2f} | "
                  f"{c['r_before_fwd'] / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
