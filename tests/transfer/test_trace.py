"""The transfer trace (``transfer/trace.py``): off by default, bounded, and what the scheduler writes to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transfer_fakes import Buffers, FakeWire, fake_target

from sglang_lynx.transfer import scheduler as scheduler_module
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.trace import Trace

KIB = 1 << 10


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_writes_nothing(tmp_path: Path) -> None:
    trace = Trace(None)
    trace.emit("issue", rid="1")
    assert not trace.enabled and trace.path is None and trace.events == 0
    assert not list(tmp_path.iterdir())


def test_on_writes_one_json_line_per_event_and_stops_at_its_bound(tmp_path: Path) -> None:
    trace = Trace(tmp_path / "t", max_events=3)
    for i in range(5):
        trace.emit("issue", rid=str(i), bytes=i, odd=object())
    assert trace.path is not None
    got = lines(trace.path)
    assert [e["ev"] for e in got] == ["issue", "issue", "issue", "truncated"]
    assert [e["rid"] for e in got[:3]] == ["0", "1", "2"] and got[2]["bytes"] == 2
    assert all(isinstance(e["t"], float) for e in got) and got[0]["thread"] == "MainThread"
    assert not trace.enabled  # after its bound: one attribute check per call again


def test_a_write_error_switches_the_trace_off(tmp_path: Path) -> None:
    trace = Trace(tmp_path)
    trace.emit("a")
    assert trace._file is not None
    trace._file.close()  # what a disk error looks like to emit: a write that raises
    trace.emit("b")
    assert not trace.enabled


@pytest.mark.timeout(30)
def test_the_scheduler_traces_every_chunk_and_landing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = Trace(tmp_path)
    monkeypatch.setattr(scheduler_module, "trace", lambda: trace)
    params = SchedulerParams(residual_chunk_bytes=64 * KIB, residual_window=2, anchor_chunk_bytes=32 * KIB)
    sched = TransferScheduler(FakeWire(bytes_per_s=64 * 1024 * KIB), params)
    bufs = Buffers()
    try:
        t = sched.submit("r1", fake_target(0, 96 * KIB, 200 * KIB), lambda: bufs.encoded(96 * KIB, 200 * KIB))
        t.anchor.future.result(timeout=10)
        t.residual.future.result(timeout=10)  # type: ignore[union-attr]
    finally:
        sched.close(2)
    assert trace.path is not None
    events = [e for e in lines(trace.path) if e.get("rid") == "r1"]
    done = {kind: [e for e in events if e["ev"] == "done" and e["kind"] == kind] for kind in ("anchor", "residual")}
    issued = {kind: [e for e in events if e["ev"] == "issue" and e["kind"] == kind] for kind in ("anchor", "residual")}
    assert sum(e["bytes"] for e in done["anchor"]) == 96 * KIB and len(done["anchor"]) == 3
    assert sum(e["bytes"] for e in done["residual"]) == 200 * KIB and len(done["residual"]) == 4
    assert [len(issued[k]) for k in ("anchor", "residual")] == [3, 4]
    assert all(e["wire_s"] >= 0 for e in done["anchor"] + done["residual"])
    encodes = [e for e in events if e["ev"] == "encode"]
    assert len(encodes) == 1 and encodes[0]["final"] is True and encodes[0]["thread"] == "lynx-encode"
    lands = [e["kind"] for e in events if e["ev"] == "land"]
    assert lands == ["anchor", "residual"]
    order = [e["ev"] for e in events]
    assert order.index("encode") < order.index("issue") and order.index("land") > order.index("done")
