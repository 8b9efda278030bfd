"""Transfer-layer benchmark: raw Mooncake vs the two-priority scheduler on an emulated link.

One command (as root it shapes a real netns/veth link with tc tbf; otherwise an application pacer):

    OMP_NUM_THREADS=1 python benchmark/transfer/bench_streams.py --link-gbps 1 10 25

Per link rate and context length (default model: 23,040 bytes of bf16 KV per token; anchor 5/16 and
residual 4/16 of that), in the same run and on the same link:

- raw: the anchor and residual buffers as two plain Mooncake writes (what SGLang does: one batch);
- sched: the same bytes through TransferScheduler (chunked, windowed, crc32 framing). ``wire`` is
  first chunk issued -> residual landed; ``e2e`` adds the crc32 computed in the encode stage;
- backlog: an anchor submitted while 3 other requests' residuals are flowing; its land time (queued ->
  landed) against the ideal anchor_bytes / link rate;
- overlap: N objects encoded by a stand-in encoder (torch affine 8-bit quantization of bf16 KV, not the
  Lynx codec) serially vs pipelined through the scheduler; hidden = serial - pipelined.

Writes benchmark/transfer/results<tag>.json and renders every results*.json there into RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.model_shape import DEFAULT_KV  # noqa: E402

from sglang_lynx.transfer.link import Link, LinkKind, open_link  # noqa: E402
from sglang_lynx.transfer.mooncake_engine import MooncakeEngine, WriteStatus  # noqa: E402
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, RequestTransfer  # noqa: E402
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler  # noqa: E402
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion  # noqa: E402

KV_BYTES_PER_TOKEN = DEFAULT_KV.bytes_per_token  # 23,040
MIB = 1 << 20
HERE = Path(__file__).resolve().parent


def stream_sizes(ctx: int) -> tuple[int, int]:
    return KV_BYTES_PER_TOKEN * ctx * 5 // 16, KV_BYTES_PER_TOKEN * ctx * 4 // 16


class Peer:
    """The receiver process (inside the namespace when the link is a real one)."""

    def __init__(self, link: Link, arena_bytes: int) -> None:
        argv = [*link.exec_prefix, sys.executable, str(HERE / "bench_receiver.py"), link.peer_addr,
                str(arena_bytes)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.session_id, self.arena, self.arena_bytes = info["session_id"], info["arena_addr"], info["arena_bytes"]
        self._bump = 0

    def region(self, n: int) -> StreamRegion:
        if self._bump + n > self.arena_bytes:
            raise RuntimeError("benchmark arena too small")
        r = StreamRegion(self.arena + self._bump, n)
        self._bump += -(-n // 4096) * 4096
        return r

    def target(self, anchor: int, residual: int) -> RemoteTarget:
        return RemoteTarget(self.session_id, self.arena, self.arena_bytes,
                            {StreamKind.ANCHOR: self.region(anchor), StreamKind.RESIDUAL: self.region(residual)})

    def reset(self) -> None:
        self._bump = 0

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        self.proc.wait(20)


class Source:
    """One registered local buffer carved into per-object source slices."""

    def __init__(self, engine: MooncakeEngine, nbytes: int) -> None:
        self.mem = (ctypes.c_char * nbytes)()
        self.base, self.nbytes, self._bump = ctypes.addressof(self.mem), nbytes, 0
        for off in range(0, nbytes, MIB):
            ctypes.memset(self.base + off, (off // MIB * 37) & 0xFF, min(MIB, nbytes - off))
        engine.register(self.base, nbytes)

    def take(self, n: int) -> LocalBuffer:
        if self._bump + n > self.nbytes:
            self._bump = 0
        buf = LocalBuffer(self.base + self._bump, n)
        self._bump += -(-n // 4096) * 4096
        return buf


def raw_write(engine: MooncakeEngine, link: Link, peer: Peer, src: Source, a: int, r: int) -> float:
    tgt = peer.target(a, r)
    t0 = time.monotonic()
    handles = [engine.submit_write(peer.session_id, src.take(n).addr, tgt.regions[k].addr, n)
               for k, n in ((StreamKind.ANCHOR, a), (StreamKind.RESIDUAL, r))]
    emulated = link.pacer.reserve(a + r, t0) if link.pacer else 0.0
    for h in handles:
        while (status := engine.poll(h)) is WriteStatus.PENDING:
            time.sleep(0.0002)
        if status is not WriteStatus.DONE:
            raise RuntimeError(f"raw write {status}")
    while time.monotonic() < emulated:
        time.sleep(0.0002)
    return time.monotonic() - t0


def wait(t: RequestTransfer) -> RequestTransfer:
    for s in t.streams.values():
        s.future.result(timeout=300)
    return t


def run_rate(engine: MooncakeEngine, link: Link, peer: Peer, src: Source, gbps: float,
             contexts: list[int], repeats: int, chunk_bytes: int) -> list[dict[str, Any]]:
    rows = []
    params = SchedulerParams(residual_chunk_bytes=chunk_bytes, residual_window=2)
    sched = TransferScheduler(engine, params, pacer=link.pacer)
    rate = gbps * 1e9 / 8
    try:
        for ctx in contexts:
            a, r = stream_sizes(ctx)
            raws, wires, e2es, anchors = [], [], [], []
            for _ in range(repeats):
                peer.reset()
                raws.append(raw_write(engine, link, peer, src, a, r))
                obj = EncodedObject(src.take(a), src.take(r))
                t = wait(sched.submit(f"s{ctx}", peer.target(a, r), lambda o=obj: o))
                wires.append(t.residual.landed_at - t.anchor.first_issue_at)  # type: ignore[union-attr]
                e2es.append(t.residual.landed_at - t.submitted_at)  # type: ignore[union-attr]
                anchors.append(t.anchor.landed_at - t.submitted_at)
            peer.reset()
            bulk_objs = [EncodedObject(src.take(4096), src.take(r)) for _ in range(3)]
            bulk = [sched.submit(f"bulk{i}", peer.target(4096, r), lambda o=o: o)
                    for i, o in enumerate(bulk_objs)]
            while bulk[0].residual.state.value != "in_flight":  # type: ignore[union-attr]
                time.sleep(0.0002)
            late_obj = EncodedObject(src.take(a), src.take(4096))
            late = sched.submit(f"late{ctx}", peer.target(a, 4096), lambda o=late_obj: o)
            for t in [*bulk, late]:
                wait(t)
            late_land = late.anchor.landed_at - late.anchor.queued_at
            raw_s, wire_s = statistics.median(raws), statistics.median(wires)
            rows.append({
                "link_gbps": gbps, "ctx": ctx, "anchor_bytes": a, "residual_bytes": r,
                "raw_s": raw_s, "sched_wire_s": wire_s, "sched_e2e_s": statistics.median(e2es),
                "anchor_landed_s": statistics.median(anchors),
                "overhead_wire": wire_s / raw_s - 1, "overhead_e2e": statistics.median(e2es) / raw_s - 1,
                "raw_gbps": (a + r) * 8 / raw_s / 1e9, "sched_gbps": (a + r) * 8 / wire_s / 1e9,
                "backlog_anchor_s": late_land, "ideal_anchor_s": a / rate,
                "backlog_anchor_vs_ideal": late_land / (a / rate),
                "bulk_residual_landed_after_anchor": all(b.residual.landed_at > late.anchor.landed_at  # type: ignore[union-attr]
                                                         for b in bulk[1:]),
            })
            print(fmt_row(rows[-1]), flush=True)
        rows.append(overlap(sched, link, peer, src, gbps))
    finally:
        sched.close(30)
    return rows


def overlap(sched: TransferScheduler, link: Link, peer: Peer, src: Source, gbps: float,
            ctx: int = 1024, n: int = 4) -> dict[str, Any]:
    """Serial (encode, then send, one by one) vs pipelined, same stand-in encoder and bytes."""
    a, r = stream_sizes(ctx)
    kv = torch.randn(ctx * KV_BYTES_PER_TOKEN // 2, dtype=torch.bfloat16)

    def encoder(anchor: LocalBuffer, residual: LocalBuffer):  # stand-in codec: affine 8-bit of bf16
        def encode() -> EncodedObject:
            x = kv.float()
            q = ((x - x.min()) / (x.max() - x.min()) * 255).round().to(torch.uint8)
            dst_a = torch.frombuffer((ctypes.c_uint8 * a).from_address(anchor.addr), dtype=torch.uint8)
            dst_r = torch.frombuffer((ctypes.c_uint8 * r).from_address(residual.addr), dtype=torch.uint8)
            dst_a.copy_(q[:a] >> 4)
            dst_r.copy_(q[:r] & 15)
            return EncodedObject(anchor, residual)
        return encode

    peer.reset()
    jobs = [(peer.target(a, r), encoder(src.take(a), src.take(r))) for _ in range(n)]
    enc_s, t0 = 0.0, time.monotonic()
    for i, (tgt, enc) in enumerate(jobs):
        t = wait(sched.submit(f"ser{i}", tgt, enc))
        enc_s += t.encode_finished_at - t.encode_started_at
    serial = time.monotonic() - t0
    t0 = time.monotonic()
    ts = [sched.submit(f"pipe{i}", tgt, enc) for i, (tgt, enc) in enumerate(jobs)]
    for t in ts:
        wait(t)
    pipelined = time.monotonic() - t0
    # measured directly from the pipelined run's timestamps (robust to load on a shared machine):
    # encode time of each object that ran while an earlier object was on the wire
    busy = [(t.anchor.first_issue_at, t.residual.landed_at) for t in ts]  # type: ignore[union-attr]
    enc = [(t.encode_started_at, t.encode_finished_at) for t in ts]
    hidden = sum(overlap_s(e, busy) for e in enc)
    enc_pipe = sum(e1 - e0 for e0, e1 in enc)
    wire = sum(w1 - w0 for w0, w1 in busy)
    row = {"link_gbps": gbps, "overlap_ctx": ctx, "objects": n, "encode_s": enc_pipe, "wire_s": wire,
           "serial_s": serial, "pipelined_s": pipelined, "hidden_s": hidden,
           "hidden_share_of_encode": hidden / enc_pipe,
           "hidden_vs_max_hideable": hidden / max(1e-9, min(enc_pipe, wire) * (n - 1) / n)}
    print(f"  overlap {gbps:g} Gb/s ctx {ctx} x{n}: encode {enc_pipe:.3f}s wire {wire:.3f}s serial "
          f"{serial:.3f}s pipelined {pipelined:.3f}s hidden {hidden:.3f}s "
          f"({row['hidden_share_of_encode']:.0%} of encode, "
          f"{row['hidden_vs_max_hideable']:.0%} of the hideable)", flush=True)
    return row


def overlap_s(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    """Length of ``span`` covered by the union of ``busy`` intervals."""
    merged: list[list[float]] = []
    for b0, b1 in sorted(busy):
        if merged and b0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b1)
        else:
            merged.append([b0, b1])
    return sum(max(0.0, min(span[1], b1) - max(span[0], b0)) for b0, b1 in merged)


def fmt_row(r: dict[str, Any]) -> str:
    return (f"{r['link_gbps']:>5g} {r['ctx']:>6} {r['raw_s'] * 1e3:9.1f} {r['sched_wire_s'] * 1e3:9.1f} "
            f"{r['sched_e2e_s'] * 1e3:9.1f} {r['overhead_wire']:+8.1%} {r['overhead_e2e']:+8.1%} "
            f"{r['raw_gbps']:7.2f} {r['backlog_anchor_s'] * 1e3:9.1f} {r['ideal_anchor_s'] * 1e3:9.1f} "
            f"{r['backlog_anchor_vs_ideal']:6.2f}x")


HEADER = ("Gb/s    ctx    raw ms  sched ms   e2e ms  ovh wire   ovh e2e  raw Gb/s  anchor ms  ideal ms  ratio")


def crc_throughput() -> float:
    data = bytes(64 * MIB)
    t0 = time.monotonic()
    zlib.crc32(data)
    return 64 * MIB / (time.monotonic() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[1.0, 10.0, 25.0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-netns", action="store_true", help="use the application pacer even as root")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--residual-chunk-kib", type=int, default=4096)
    ap.add_argument("--tag", default="", help="suffix of the results JSON file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    a_max, r_max = stream_sizes(max(args.contexts))
    a_4k, r_4k = stream_sizes(4096)
    arena = max(2 * (a_max + r_max) + 3 * r_max, 4 * (a_4k + r_4k + 8192)) + 8 * MIB
    results: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                               "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                               "crc32_GBps": crc_throughput(), "rows": [],
                               "residual_chunk_kib": args.residual_chunk_kib, "residual_window": 2}
    with open_link(args.link_gbps[0], prefer_netns=not args.no_netns) as link:
        results["emulation"] = link.kind.value + (f" ({link.reason})" if link.reason else "")
        print(f"link emulation: {link.describe()}; crc32 {results['crc32_GBps']:.2f} GB/s", flush=True)
        engine = MooncakeEngine.start(link.host_addr if link.kind is LinkKind.NETNS_TBF else "127.0.0.1")
        peer, src = Peer(link, arena), Source(engine, arena)
        try:
            print(HEADER)
            for gbps in args.link_gbps:
                link.set_rate(gbps)
                results["rows"] += run_rate(engine, link, peer, src, gbps, args.contexts, args.repeats,
                                            args.residual_chunk_kib * 1024)
        finally:
            peer.close()
            engine.close()
    (args.out / f"results{args.tag}.json").write_text(json.dumps(results, indent=1))
    from report import write_markdown  # local module beside this script
    runs = [json.loads(p.read_text()) for p in sorted(args.out.glob("results*.json"))]
    write_markdown(runs, args.out / "RESULTS.md")


if __name__ == "__main__":
    main()
