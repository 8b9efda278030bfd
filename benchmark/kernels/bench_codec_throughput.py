"""Encode / decode throughput of the lynx codec paths beside a plain memory copy of the same bytes, same run.

One command (CPU)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/kernels/bench_codec_throughput.py --threads 1 2

On a GPU (Triton kernels against the device copy; untested here, no GPU was lent)::

    .venv/bin/python benchmark/kernels/bench_codec_throughput.py --device cuda

Input per context: ``layers`` layers of keys and of values, each ``[tokens, 3, 64]`` bf16 (the default
model's KV shape), random with an outlier channel. GB/s = bytes of bf16 input per second, best of
``--repeats``; ``copy`` is ``dst.copy_(src)`` of every layer's bytes into preallocated buffers. Paths:
``torch-ref`` (``get_codec("lynx")``, timed on ``--ref-layers`` layers because it is slow; GB/s is
per byte so comparable), ``cpu-fast`` (``sglang_lynx.kernels.lynx_cpu_fast``) on the CPU, ``triton``
(``sglang_lynx.kernels.lynx_triton``) on cuda. Decode writes bf16 into a preallocated pool buffer,
anchor-only (``dec-a``) and full (``dec-f``). Writes ``results/throughput-<device>.json`` and
``RESULTS.md`` beside this file (``--no-write`` to skip).

Threads (CPU): ``cpu-fast`` runs once per ``--threads`` count (``threads=`` of ``lynx_cpu_fast``: one
layer's pages split over that many threads); a count above 1 is the row ``cpu-fast-<n>t``, and its
``copy_GBps`` is a copy split the same way (row ranges of each layer on the same number of threads), so
every ratio compares equal thread counts; ``copy_1t_GBps`` is the single-threaded copy. ``torch-ref``
runs single-threaded (``OMP_NUM_THREADS=1``). The load average before and after the run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ENCODE_TARGET, DECODE_TARGET = 0.10, 0.20  # CPU targets (fraction of copy bandwidth); GPU: 0.5 each


def best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def make_layers(tokens: int, layers: int, device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        x = torch.randn(tokens, 3, 64, generator=gen) * (torch.rand(3, 64, generator=gen) * 3 + 0.1)
        x[:, 0, 5] += 40.0
        out.append(x.to(torch.bfloat16).to(device))
    return out


def copy_layers(
    xs_all: dict[str, list[torch.Tensor]],
    dsts: dict[str, list[torch.Tensor]],
    threads: int,
    pool: ThreadPoolExecutor | None,
) -> None:
    """``dst.copy_(x)`` for every layer, each layer's rows split into ``threads`` ranges run at once."""
    for kind, layers in xs_all.items():
        for x, dst in zip(layers, dsts[kind], strict=True):
            if threads <= 1 or pool is None:
                dst.copy_(x)
                continue
            rows = x.shape[0]
            bounds = [rows * i // threads for i in range(threads + 1)]
            parts = [(dst[a:b], x[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
            futures = [pool.submit(d.copy_, s) for d, s in parts[1:]]
            parts[0][0].copy_(parts[0][1])
            for f in futures:
                f.result()


def measure_path(
    name: str, module: Any, xs: dict[str, list[torch.Tensor]], repeats: int, sync, threads: int | None = None
) -> dict[str, float]:
    """Seconds to encode / decode every layer of ``xs`` with one path (``threads``: cpu-fast only)."""
    if name == "torch-ref":
        from sglang_lynx.codec.registry import get_codec

        codec = get_codec("lynx")
        encode = lambda x, kind: codec.encode(x, kind)  # noqa: E731

        def decode(enc, pool, slots, with_residual):
            return codec.decode(enc, with_residual=with_residual, out=pool)
    else:
        extra = {"threads": threads} if threads is not None else {}
        encode = lambda x, kind: module.encode(x, kind, **extra)  # noqa: E731

        def decode(enc, pool, slots, with_residual):
            residual = enc.residual if with_residual else None
            return module.decode_into(enc.anchor, residual, pool, slots, kind=enc.kind, **extra)

    encoded = {kind: [encode(x, kind) for x in layers] for kind, layers in xs.items()}
    first = xs["k"][0]
    pools = {kind: [torch.empty_like(x) for x in layers] for kind, layers in xs.items()}
    slots = torch.arange(first.shape[0], dtype=torch.int64, device=first.device)

    def run_encode() -> None:
        for kind, layers in xs.items():
            for x in layers:
                encode(x, kind)

    def run_decode(with_residual: bool) -> None:
        for kind in xs:
            for enc, pool in zip(encoded[kind], pools[kind], strict=True):
                decode(enc, pool, slots, with_residual)

    return {
        "encode_s": best_seconds(run_encode, repeats, sync),
        "decode_anchor_s": best_seconds(lambda: run_decode(False), repeats, sync),
        "decode_full_s": best_seconds(lambda: run_decode(True), repeats, sync),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--ref-layers", type=int, default=2, help="layers timed for the slow torch reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="cpu-fast thread counts to time (default: 1 and lynx_cpu_fast.default_threads() if more)",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available on this machine")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    load_before = os.getloadavg()
    if args.device == "cuda":
        from sglang_lynx.kernels import lynx_triton as fast_module

        paths = [("torch-ref", None, args.ref_layers, 1), ("triton", fast_module, args.layers, 1)]
    else:
        from sglang_lynx.kernels import lynx_cpu_fast as fast_module

        counts = args.threads or sorted({1, fast_module.default_threads()})
        paths = [("torch-ref", None, args.ref_layers, 1)]
        paths += [("cpu-fast" if n == 1 else f"cpu-fast-{n}t", fast_module, args.layers, n) for n in counts]
    workers = max(n for *_, n in paths)
    pool = ThreadPoolExecutor(workers - 1) if workers > 1 else None
    rows = []
    for tokens in args.tokens:
        xs_all = {kind: make_layers(tokens, args.layers, args.device, seed) for kind, seed in (("k", 1), ("v", 2))}
        dsts = {kind: [torch.empty_like(x) for x in layers] for kind, layers in xs_all.items()}
        total_bytes = sum(x.numel() * x.element_size() for layers in xs_all.values() for x in layers)
        copy_gbs = {}
        for n in sorted({1} | {n for *_, n in paths}):  # a copy on each thread count timed (1: the plain copy)
            seconds = best_seconds(lambda n=n, xs=xs_all, ds=dsts: copy_layers(xs, ds, n, pool), args.repeats, sync)
            copy_gbs[n] = total_bytes / seconds / 1e9
        for name, module, layers, threads in paths:
            xs = {kind: v[:layers] for kind, v in xs_all.items()}
            nbytes = sum(x.numel() * x.element_size() for v in xs.values() for x in v)
            cpu_threads = threads if name.startswith("cpu-fast") else None
            times = measure_path(name, module, xs, args.repeats, sync, cpu_threads)
            row = {"tokens": tokens, "layers": min(layers, args.layers), "path": name, "threads": threads,
                   "bytes": nbytes, "copy_GBps": copy_gbs[threads], "copy_1t_GBps": copy_gbs[1]}  # fmt: skip
            for key, seconds in times.items():
                gbs = nbytes / seconds / 1e9
                row[key.replace("_s", "_GBps")] = gbs
                row[key.replace("_s", "_of_copy")] = gbs / row["copy_GBps"]
            rows.append(row)
            print(
                f"{tokens:>6} tok x {row['layers']:>2} layers  {name:<11}  "
                f"copy({threads}t) {row['copy_GBps']:6.2f} GB/s  "
                f"enc {row['encode_GBps']:7.3f} ({100 * row['encode_of_copy']:5.1f}%)  "
                f"dec-a {row['decode_anchor_GBps']:7.3f} ({100 * row['decode_anchor_of_copy']:5.1f}%)  "
                f"dec-f {row['decode_full_GBps']:7.3f} ({100 * row['decode_full_of_copy']:5.1f}%)",
                flush=True,
            )
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
    }
    command = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} .venv/bin/python benchmark/kernels/"
    command += Path(__file__).name + " " + " ".join(sys.argv[1:])
    if not args.no_write:
        (HERE / "results").mkdir(exist_ok=True)
        result = {"command": command.strip(), "machine": machine, "rows": rows}
        (HERE / "results" / f"throughput-{args.device}.json").write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(result, args.device)


def write_markdown(result: dict[str, Any], device: str) -> None:
    target = (ENCODE_TARGET, DECODE_TARGET) if device == "cpu" else (0.5, 0.5)
    lines = [
        f"## Throughput on {device} (written by bench_codec_throughput.py)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {json.dumps(result['machine'])}",
        "",
        f"Targets: encode >= {target[0]:.0%}, decode >= {target[1]:.0%} of the copy bandwidth of the same run.",
        "",
        "Threads: each row's copy GB/s is a copy on its number of threads (single-threaded copy in brackets).",
        "",
        "| tokens | layers | path | threads | copy GB/s | encode GB/s (% copy) | decode anchor GB/s (% copy) "
        "| decode full GB/s (% copy) | targets met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        decode_min = min(r["decode_anchor_of_copy"], r["decode_full_of_copy"])
        met = r["encode_of_copy"] >= target[0] and decode_min >= target[1]
        single = f" ({r['copy_1t_GBps']:.2f})" if r.get("threads", 1) != 1 else ""
        lines.append(
            f"| {r['tokens']} | {r['layers']} | {r['path']} | {r.get('threads', 1)} | {r['copy_GBps']:.2f}{single} "
            f"| {r['encode_GBps']:.3f} ({100 * r['encode_of_copy']:.1f}%) "
            f"| {r['decode_anchor_GBps']:.3f} ({100 * r['decode_anchor_of_copy']:.1f}%) "
            f"| {r['decode_full_GBps']:.3f} ({100 * r['decode_full_of_copy']:.1f}%) | {'yes' if met else 'no'} |"
        )
    section = "\n".join(lines) + "\n"
    path = HERE / "RESULTS.md"
    notes = path.read_text().split("## Throughput on")[0] if path.exists() else "# Codec kernel throughput\n\n"
    other = ""
    if path.exists():
        parts = path.read_text().split("## Throughput on")[1:]
        other = "".join("## Throughput on" + p for p in parts if not p.startswith(f" {device} "))
    path.write_text(notes.rstrip() + "\n\n" + other + section)


if __name__ == "__main__":
    main()
