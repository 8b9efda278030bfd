"""Anchor-landed and residual-landed time per Lynx mode, through the real scheduler and real Mooncake.

For each mode the stream sizes are what the prefill puts on the wire (``request_stream_bytes`` of the
default model, ``lynx``'s residual without what its anchor's trailer carries: ``wire_residual``;
30 layers, 3 KV heads, head dim 64, ``LynxConfig(mode=...)`` defaults); the bytes cross one emulated
link (the application pacer, or a real netns + ``tc`` link as root) from this process to a receiver
process through :class:`TransferScheduler` exactly as the prefill server sends them: one stream for the
one-stream codecs (bf16, int8, int4, kivi, lynx-int4), anchor then residual for the two-stream codec
(``lynx-int8`` and ``lynx``: the decode of ``lynx-int8`` can start only when the residual has landed,
``lynx`` when the anchor has).
The contents are not encoded here (the wire does not care; ``bench_codec`` / the kernels benchmark
time the codec), so the times are the transport's alone.

    OMP_NUM_THREADS=1 python benchmark/transfer/bench_modes.py --link-gbps 1 10 25 \\
        --contexts 1024 4096 16384 --repeats 3

Per (link, context, mode): anchor landed (submit -> landed) and, for lynx, residual landed, medians
over the repeats, next to the ideal bytes / link rate. Writes ``modes<tag>.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.model_shape import DEFAULT_KV  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from benchmark.transfer.bench_streams import MIB, Peer, Source, wait  # noqa: E402

from sglang_lynx.codec.registry import get_codec  # noqa: E402
from sglang_lynx.codec.request import request_stream_bytes  # noqa: E402
from sglang_lynx.codec.wire_residual import residual_wire_bytes  # noqa: E402
from sglang_lynx.config import LynxConfig  # noqa: E402
from sglang_lynx.transfer.link import LinkKind, open_link  # noqa: E402
from sglang_lynx.transfer.mooncake_engine import MooncakeEngine  # noqa: E402
from sglang_lynx.transfer.progress import EncodedObject  # noqa: E402
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("bf16", "int8", "int4", "kivi-int4", "kivi-int2", "lynx-int4", "lynx-int8", "lynx")
LAYERS, HEADS, HEAD_DIM = DEFAULT_KV.layers, DEFAULT_KV.kv_heads, DEFAULT_KV.head_dim


def mode_sizes(mode: str, ctx: int) -> tuple[int, int, bool]:
    """(anchor bytes, residual bytes, two streams?) of one request of ``ctx`` tokens in ``mode``."""
    config = LynxConfig(mode=mode)
    codec = get_codec(config.codec_name, **config.codec_params())
    anchor, residual = request_stream_bytes(codec, LAYERS, ctx, HEADS, HEAD_DIM)
    two = codec.two_streams and residual > 0
    residual = residual_wire_bytes(codec, LAYERS, ctx, HEADS, HEAD_DIM) if two else residual
    return (anchor, residual, True) if two else (anchor + residual, 0, False)


def measure(sched: TransferScheduler, peer: Peer, src: Source, mode: str, ctx: int, gbps: float,
            repeats: int) -> dict[str, Any]:
    a, r, two = mode_sizes(mode, ctx)
    anchors, residuals = [], []
    for i in range(repeats):
        peer.reset()
        obj = EncodedObject(src.take(a), src.take(r) if two else None)
        t = wait(sched.submit(f"{mode}-{ctx}-{i}", peer.target(a, max(r, 1)), lambda o=obj: o, progressive=two))
        anchors.append(t.anchor.landed_at - t.submitted_at)
        if t.residual is not None:
            residuals.append(t.residual.landed_at - t.submitted_at)
    rate = gbps * 1e9 / 8
    bf16 = LAYERS * 2 * HEADS * HEAD_DIM * 2 * ctx
    return {"link_gbps": gbps, "ctx": ctx, "mode": mode, "anchor_bytes": a, "residual_bytes": r,
            "bits_anchor": a * 8 / (bf16 / 2), "bits_total": (a + r) * 8 / (bf16 / 2),
            "anchor_landed_s": statistics.median(anchors),
            "residual_landed_s": statistics.median(residuals) if residuals else None,
            "ideal_anchor_s": a / rate, "ideal_total_s": (a + r) / rate}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| link Gb/s | ctx | mode | bits/value anchor | bits/value total | anchor landed ms | ideal ms | "
             "residual landed ms | ideal ms |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        res = "-" if r["residual_landed_s"] is None else f"{r['residual_landed_s'] * 1e3:.1f}"
        res_ideal = "-" if r["residual_landed_s"] is None else f"{r['ideal_total_s'] * 1e3:.1f}"
        lines.append(f"| {r['link_gbps']:g} | {r['ctx']} | {r['mode']} | {r['bits_anchor']:.2f} | "
                     f"{r['bits_total']:.2f} | {r['anchor_landed_s'] * 1e3:.1f} | {r['ideal_anchor_s'] * 1e3:.1f} | "
                     f"{res} | {res_ideal} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[1.0, 10.0, 25.0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-netns", action="store_true", help="use the application pacer even as root")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    biggest = max(sum(mode_sizes(m, max(args.contexts))[:2]) for m in args.modes)
    arena = 2 * biggest + 16 * MIB
    rows: list[dict[str, Any]] = []
    with open_link(args.link_gbps[0], prefer_netns=not args.no_netns) as link:
        emulation = link.kind.value + (f" ({link.reason})" if link.reason else "")
        print(f"link emulation: {link.describe()}", flush=True)
        engine = MooncakeEngine.start(link.host_addr if link.kind is LinkKind.NETNS_TBF else "127.0.0.1")
        peer, src = Peer(link, arena), Source(engine, arena)
        try:
            for gbps in args.link_gbps:
                link.set_rate(gbps)
                sched = TransferScheduler(engine, SchedulerParams(), pacer=link.pacer)
                try:
                    for ctx in args.contexts:
                        for mode in args.modes:
                            rows.append(measure(sched, peer, src, mode, ctx, gbps, args.repeats))
                            print(markdown(rows[-1:])[-1], flush=True)
                finally:
                    sched.close(30)
        finally:
            peer.close()
            engine.close()
    out = args.out / f"modes{args.tag}.json"
    out.write_text(json.dumps({"provenance": provenance(), "emulation": emulation, "rows": rows}, indent=1))
    print("\n".join(markdown(rows)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
