"""What the transfer scheduler's sender thread costs while chunks are on a slow wire.

One command::

    OMP_NUM_THREADS=1 python benchmark/transfer/sender_poll.py --seconds 2 --repeats 3

A real :class:`~sglang_lynx.transfer.scheduler.TransferScheduler` sends one request (an anchor and a
residual, 256 KiB chunks) over a fake FIFO wire (``tests/transfer/transfer_fakes.py``) paced so that its bytes
take ``--seconds``: nothing but the sender thread works meanwhile. Reported: the process's CPU seconds per wall
second (the sender's polling: everything else is asleep), how many times the engine was polled, and how late
each chunk's finish was seen (median and max, from the wire's finish time to the chunk's ``done``). Writes
``--out`` (JSON with command, commit, machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "transfer"))

from benchmark.provenance import provenance  # noqa: E402
from transfer_fakes import Buffers, FakeWire, fake_target  # noqa: E402

from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler  # noqa: E402

KIB = 1 << 10


class CountingWire(FakeWire):
    """The fake wire, counting polls and when each write's finish was first seen."""

    def __init__(self, bytes_per_s: float) -> None:
        super().__init__(bytes_per_s)
        self.polls, self.seen_late = 0, []

    def poll(self, h: Any) -> Any:
        self.polls += 1
        status = super().poll(h)
        if h.reported.value != "pending" and not getattr(h, "seen", False):
            h.seen = True
            self.seen_late.append(time.monotonic() - h.finish_at)
        return status


def one_run(seconds: float) -> dict[str, Any]:
    anchor, residual = 512 * KIB, 2048 * KIB
    wire = CountingWire((anchor + residual) / seconds)
    params = SchedulerParams(residual_chunk_bytes=256 * KIB, anchor_chunk_bytes=256 * KIB, residual_window=2)
    sched = TransferScheduler(wire, params)
    bufs = Buffers()
    try:
        start_wall, start_cpu = time.monotonic(), time.process_time()
        t = sched.submit("r", fake_target(0, anchor, residual), lambda: bufs.encoded(anchor, residual))
        t.residual.future.result(timeout=seconds * 5 + 10)  # type: ignore[union-attr]
        wall, cpu = time.monotonic() - start_wall, time.process_time() - start_cpu
    finally:
        sched.close(5)
    return {"wall_s": wall, "cpu_s": cpu, "cpu_per_wall_s": cpu / wall, "polls": wire.polls,
            "polls_per_s": wire.polls / wall, "finish_seen_late_ms_median": 1e3 * statistics.median(wire.seen_late),
            "finish_seen_late_ms_max": 1e3 * max(wire.seen_late), "chunks": len(wire.seen_late),
            "poll_interval_s": params.poll_interval_s,
            "poll_max_s": getattr(params, "poll_max_s", params.poll_interval_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark/transfer/sender_poll.json"))
    args = parser.parse_args()
    runs = [one_run(args.seconds) for _ in range(args.repeats)]
    for r in runs:
        print(f"wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.3f} s ({100 * r['cpu_per_wall_s']:.1f}% of a core), "
              f"{r['polls']} polls ({r['polls_per_s']:.0f}/s), finish seen {r['finish_seen_late_ms_median']:.2f} ms "
              f"late (max {r['finish_seen_late_ms_max']:.2f}) over {r['chunks']} chunks")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
