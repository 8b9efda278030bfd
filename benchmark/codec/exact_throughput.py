"""Throughput of the ``lynx-exact`` stream's C fast path on real KV, against a memory copy in the same run.

Called by ``throughput.py --exact-tokens ...`` (its results file and RESULTS.md section). Per prompt length:
one local-text prompt through the default model in bf16 (``exact_bits.capture_kv``: post-RoPE K and V of
all 30 layers; ``--kv-cache DIR`` keeps them between runs), each layer's K and V encoded with ``lynx``, then
per repeat the exact streams of every layer encoded (``kernels.lynx_exact_cpu.encode_exact``, from the BF16
KV and its lynx encoding) and decoded (``decode_exact``, to BF16; checked bit for bit once), with one C worker
and with ``threads=2`` (its bytes and tensors checked equal to one worker's once), one call per layer; and all
the layers in one call with ``threads=2`` (``kernels.lynx_exact_layers``: two layers at a time, each on one
thread; run ``2L``, keys ``_2t_layers``; checked equal once too; decoding into BF16 tensors allocated once, its
``out=``, as a caller writing into its KV pool would: 60 new tensors per call would add the kernel's page
zeroing to the time, which the per-layer loop avoids by reusing each freed one). MB/s are bytes of BF16 KV per
second; the memory copy is ``Tensor.copy_`` of a buffer of the same size (best of 3 per repeat), and for two
threads (both runs) two Python threads each copying one half (``copy_`` releases the GIL; torch at one
intra-op thread), timed together. Wall-clock medians over the repeats (and their best, and CPU-time medians): the
machine is shared, so the load average is recorded beside them. Also: the bin bounds the C path's fast bounds
left to its window search (``lynx_exact_cpu.fallbacks``) in one encode of every layer (of at most 2 per value).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

TARGET_ENCODE_SHARE, TARGET_DECODE_SHARE = 0.05, 0.10
THREADS = (1, 2)
#: (label, C threads, all layers in one call): the runs timed, each against the copy of as many threads
RUNS: tuple[tuple[str, int, bool], ...] = (("1", 1, False), ("2", 2, False), ("2L", 2, True))


def real_kv(tokens: int, seed: int, cache: Path | None) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(source, per layer (K, V)) of the default model on one local-text prompt, from ``cache`` when there."""
    path = cache / f"kv-{tokens}-seed{seed}.pt" if cache else None
    if path is not None and path.exists():
        saved = torch.load(path)
        return saved["source"], saved["kv"]
    from benchmark.pd_modes import default_model_path
    from exact_bits import capture_kv

    source, kv = capture_kv(default_model_path(), tokens, seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"source": source, "kv": kv}, path)
    return source, kv


def copy_mb_s(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e6


def copy2_mb_s(nbytes: int) -> float:
    """Two threads each copying one half of ``nbytes``, started together (best of 3)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    halves = [(dst[: nbytes // 2], src[: nbytes // 2]), (dst[nbytes // 2 :], src[nbytes // 2 :])]
    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=d.copy_, args=(s,)) for d, s in halves]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e6


def _suffix(threads: int, layers: bool = False) -> str:
    return ("" if threads == 1 else f"_{threads}t") + ("_layers" if layers else "")


def _label(threads: int, layers: bool) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''}" + (", layers at once" if layers else "")


def measure_length(tokens: int, seed: int, repeats: int, cache: Path | None) -> dict[str, Any]:
    from exact_bits import lynx_encode
    from sglang_lynx.kernels import lynx_exact_cpu, lynx_exact_layers

    from sglang_lynx.codec.layout import LayoutParams
    from sglang_lynx.codec.registry import get_codec

    lynx_exact_cpu.build()
    params = LayoutParams()
    codec = get_codec("lynx", **vars(params))
    source, kv = real_kv(tokens, seed, cache)
    layers = [(x, lynx_encode(codec, x, kind, layer))
              for layer, pair in enumerate(kv) for kind, x in zip("kv", pair, strict=True)]  # fmt: skip
    nbytes = sum(2 * x.numel() for x, _ in layers)
    fallbacks = getattr(lynx_exact_cpu, "fallbacks", lambda: 0)  # absent before the fast bounds
    before = fallbacks()
    streams = [lynx_exact_cpu.encode_exact(x, enc, params) for x, enc in layers]
    fallback_count = fallbacks() - before  # in one encode of every layer (at most 2 bounds per value)
    for (x, enc), stream in zip(layers, streams, strict=True):
        for threads in THREADS:
            if threads > 1 and lynx_exact_cpu.encode_exact(x, enc, params, threads=threads) != stream:
                raise AssertionError(f"{tokens} tokens: {threads} C workers encoded other bytes than one")
            back = lynx_exact_cpu.decode_exact(enc, stream, params, threads=threads)
            if not torch.equal(back.view(torch.int16), x.view(torch.int16)):
                raise AssertionError(f"{tokens} tokens: the exact stream did not restore the KV bit for bit")
    jobs = [(enc, stream) for (_, enc), stream in zip(layers, streams, strict=True)]
    backs = lynx_exact_layers.decode_exact_layers(jobs, params, threads=2)
    if lynx_exact_layers.encode_exact_layers(layers, params, threads=2) != streams or not all(
        torch.equal(back.view(torch.int16), x.view(torch.int16)) for back, (x, _) in zip(backs, layers, strict=True)
    ):
        raise AssertionError(f"{tokens} tokens: the layers-at-once calls gave other bytes or tensors")
    outs = [torch.empty_like(x) for x, _ in layers]  # the layers-at-once decode writes here (out=)
    runs = [(name, run) for run in RUNS for name in ("encode", "decode")]
    wall: dict[tuple[str, Any], list[float]] = {run: [] for run in runs}
    cpu: dict[tuple[str, Any], list[float]] = {run: [] for run in runs}
    copies: dict[int, list[float]] = {threads: [] for threads in THREADS}
    loads = [os.getloadavg()[0]]
    for _ in range(repeats):
        for name, (label, threads, at_once) in runs:
            start, start_cpu = time.perf_counter(), time.process_time()
            if at_once and name == "encode":
                lynx_exact_layers.encode_exact_layers(layers, params, threads=threads)
            elif at_once:
                lynx_exact_layers.decode_exact_layers(jobs, params, threads=threads, out=outs)
            elif name == "encode":
                for x, enc in layers:
                    lynx_exact_cpu.encode_exact(x, enc, params, threads=threads)
            else:
                for enc, stream in jobs:
                    lynx_exact_cpu.decode_exact(enc, stream, params, threads=threads)
            wall[(name, (label, threads, at_once))].append(time.perf_counter() - start)
            cpu[(name, (label, threads, at_once))].append(time.process_time() - start_cpu)
        for threads in THREADS:
            copies[threads].append(copy_mb_s(nbytes) if threads == 1 else copy2_mb_s(nbytes))
        loads.append(os.getloadavg()[0])
    out: dict[str, Any] = {
        "source": source, "module": lynx_exact_cpu.__file__, "values": nbytes // 2,
        "exact_bytes": sum(len(s) for s in streams), "loadavg_1min": loads, "fast_bound_fallbacks": fallback_count,
        "bounds_at_most": nbytes, "threads": list(THREADS), "runs": [label for label, _, _ in RUNS],
    }  # fmt: skip
    for threads in THREADS:
        tag = _suffix(threads)
        out[f"memcpy_mb_s{tag}"], out[f"memcpy_mb_s{tag}_runs"] = statistics.median(copies[threads]), copies[threads]
    for run in RUNS:
        _, threads, at_once = run
        tag, copy = _suffix(threads, at_once), out[f"memcpy_mb_s{_suffix(threads)}"]
        for name in ("encode", "decode"):
            out[f"{name}_mb_s{tag}"] = nbytes / statistics.median(wall[(name, run)]) / 1e6
            out[f"{name}_mb_s{tag}_best"] = nbytes / min(wall[(name, run)]) / 1e6
            out[f"{name}_mb_s{tag}_cpu_time"] = nbytes / statistics.median(cpu[(name, run)]) / 1e6
            out[f"{name}_share_of_memcpy{tag}"] = out[f"{name}_mb_s{tag}"] / copy
    return out


def measure(lengths: list[int], seed: int, repeats: int, cache: Path | None) -> dict[str, Any]:
    results = {}
    for tokens in lengths:
        m = measure_length(tokens, seed, repeats, cache)
        results[str(tokens)] = m
        for _, threads, at_once in RUNS:
            tag = _suffix(threads, at_once)
            print(f"exact {tokens} tokens, {_label(threads, at_once)}: encode {m[f'encode_mb_s{tag}']:.0f} MB/s "
                  f"({m[f'encode_share_of_memcpy{tag}']:.2%}), decode {m[f'decode_mb_s{tag}']:.0f} MB/s "
                  f"({m[f'decode_share_of_memcpy{tag}']:.2%}), memcpy {m[f'memcpy_mb_s{_suffix(threads)}']:.0f} MB/s, "
                  f"load {m['loadavg_1min']}", flush=True)  # fmt: skip
    targets = {}
    for _, threads, at_once in RUNS:
        tag, label = _suffix(threads, at_once), _label(threads, at_once)
        for name, share in (("encode", TARGET_ENCODE_SHARE), ("decode", TARGET_DECODE_SHARE)):
            targets[f"{name} >= {share:.0%} of memcpy, {label}"] = all(
                m[f"{name}_share_of_memcpy{tag}"] >= share for m in results.values())
    return {
        "lengths": results,
        "targets": targets,
        "repeats": repeats,
        "what": "kernels.lynx_exact_cpu encode_exact / decode_exact over all 30 layers' K and V, threads=1 and 2 "
                "(C workers), one call per layer; and kernels.lynx_exact_layers encode_exact_layers / "
                "decode_exact_layers, all layers in one call, threads=2 (two layers at a time, keys _2t_layers; decode "
                "into tensors allocated once, out=); "
                "MB/s of BF16 KV, wall-clock median over repeats; memcpy: Tensor.copy_ of the same bytes, for 2 "
                "threads two Python threads copying one half each",
    }  # fmt: skip


def markdown(exact: dict[str, Any], machine: str, command: str) -> str:
    lines = [
        "### lynx-exact stream, C fast path, on real KV of the default model (all 30 layers, K and V)",
        "",
        f"Machine: {machine}. Command: `{command}`. One C worker (`threads=1`) and two (`threads=2`, against two "
        "threads each copying one half, started together), one call per layer; `2L`: all layers in one call "
        "(`lynx_exact_layers`, `threads=2`: two layers at a time, decoding into tensors allocated once, against the "
        "same two-thread copy); wall-clock median of "
        f"{exact['repeats']} repeats (best and CPU-time median beside: with 2 threads CPU time counts both); "
        "memory copies of the same bytes in the same run; the machine is shared, the 1-minute load average during "
        "the run is given.",
        "",
        "| tokens | threads | encode MB/s (best, CPU time) | encode % of copy | decode MB/s (best, CPU time) "
        "| decode % of copy | memcpy MB/s | load | fast-bound fallbacks (one encode) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, m in exact["lengths"].items():
        for label, threads, at_once in [run for run in RUNS if run[0] in m.get("runs", ["1"])]:
            t = _suffix(threads, at_once)
            lines.append(
                f"| {tokens} | {label} | {m[f'encode_mb_s{t}']:.0f} ({m[f'encode_mb_s{t}_best']:.0f}, "
                f"{m[f'encode_mb_s{t}_cpu_time']:.0f}) | {m[f'encode_share_of_memcpy{t}']:.2%} | "
                f"{m[f'decode_mb_s{t}']:.0f} ({m[f'decode_mb_s{t}_best']:.0f}, {m[f'decode_mb_s{t}_cpu_time']:.0f}) | "
                f"{m[f'decode_share_of_memcpy{t}']:.2%} | {m[f'memcpy_mb_s{_suffix(threads)}']:.0f} | "
                f"{min(m['loadavg_1min']):.1f}-{max(m['loadavg_1min']):.1f} | "
                f"{m['fast_bound_fallbacks']} of <= {m['bounds_at_most']} |"
            )
    lines += ["", "Targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in exact["targets"].items())]
    return "\n".join(lines) + "\n"
