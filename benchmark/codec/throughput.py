"""Encode / decode throughput of the torch reference codecs beside a plain memory copy, same run.

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/throughput.py --tokens 16384 --exact-tokens 1024 4096 8192

Input: one layer's keys ``[tokens, 3, 64]`` bf16 (the default model's shape), random with an
outlier channel. GB/s are bytes of bf16 input per second (best of ``--repeats``); the copy row is
``dst.copy_(src)`` of the same bytes. Decode writes into a preallocated bf16 tensor (``out=``).
``--exact-tokens``: also the ``lynx-exact`` stream's C fast path on real KV of the default model at those
prompt lengths (``exact_throughput.py``; ``--exact-tokens`` alone skips it, ``--codecs`` alone the torch
codecs). Writes ``results/throughput.json`` (with the command, commit, machine and load) and sections of
``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parents[1]))

from benchmark.provenance import machine_summary, provenance  # noqa: E402
from exact_throughput import markdown as exact_markdown  # noqa: E402
from exact_throughput import measure as measure_exact  # noqa: E402
from results_md import replace_section  # noqa: E402

from sglang_lynx.codec.registry import get_codec  # noqa: E402

CODECS = ["lynx", "lynx-paper", "kivi-int4", "int8", "int4"]


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--codecs", nargs="*", default=CODECS, help="torch reference codecs to time (none: skip)")
    parser.add_argument("--exact-tokens", type=int, nargs="*", default=[1024, 4096, 8192],
                        help="prompt lengths of real KV for the lynx-exact C path (none: skip)")
    parser.add_argument("--exact-repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0, help="the local-text prompt of the real KV")
    parser.add_argument("--kv-cache", type=Path, default=None, help="keep the captured real KV here between runs")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "throughput.json")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 3, 64, generator=gen) * (torch.rand(3, 64, generator=gen) * 3)
    x[:, 0, 5] += 20
    x = x.to(torch.bfloat16)
    nbytes = x.numel() * 2
    dst = torch.empty_like(x)
    copy_gbs = nbytes / best_seconds(lambda: dst.copy_(x), args.repeats) / 1e9
    rows = [{"codec": "memory copy", "encode_gbs": copy_gbs, "decode_gbs": copy_gbs, "kind": "-"}]
    for name in args.codecs:
        codec = get_codec(name)
        for kind in ("k", "v"):
            enc = codec.encode(x, kind)  # type: ignore[arg-type]
            enc_s = best_seconds(lambda c=codec, k=kind: c.encode(x, k), args.repeats)  # type: ignore[misc]
            full = codec.two_streams
            dec_s = best_seconds(
                lambda c=codec, e=enc, f=full: c.decode(e, with_residual=f, out=dst),
                args.repeats,  # type: ignore[misc]
            )
            rows.append(
                {"codec": name, "kind": kind, "encode_gbs": nbytes / enc_s / 1e9, "decode_gbs": nbytes / dec_s / 1e9}
            )
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"
    lines = [
        f"### Throughput of the torch reference ({args.tokens} tokens x 3 heads x 64 dims bf16, {nbytes / 1e6:.1f} MB)",
        "",
        f"Machine: {machine} (shared machine, other jobs running). Command: `python {' '.join(sys.argv)}`.",
        "GB/s of bf16 input, best of repeats; % is of the memory copy measured in the same run.",
        "",
        "| codec | kind | encode GB/s | encode % of copy | decode GB/s (full) | decode % of copy |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['codec']} | {row['kind']} | {row['encode_gbs']:.3f} | {100 * row['encode_gbs'] / copy_gbs:.1f}% "
            f"| {row['decode_gbs']:.3f} | {100 * row['decode_gbs'] / copy_gbs:.1f}% |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    prov = provenance()
    exact = None
    if args.exact_tokens:
        exact = measure_exact(args.exact_tokens, args.seed, args.exact_repeats, args.kv_cache)
    exact_table = exact_markdown(exact, machine_summary(prov["machine"]), prov["command"]) if exact else ""
    print(exact_table)
    if not args.no_write:
        args.out.parent.mkdir(exist_ok=True)
        result = {"machine": machine, "provenance": prov, "rows": rows, **({"exact": exact} if exact else {})}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        if args.codecs:
            replace_section(HERE / "RESULTS.md", "throughput", table)
        if exact:
            replace_section(HERE / "RESULTS.md", "throughput-exact", exact_table)


if __name__ == "__main__":
    main()
