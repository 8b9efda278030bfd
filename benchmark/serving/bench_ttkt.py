"""Time to the k-th token per Lynx mode, through the router of a real PD deployment.

For each mode a PD deployment (prefill + decode over Mooncake + sglang_router, default model) is
started with ``--lynx --lynx-config MODE``; the Lynx streams cross an emulated link of
``--link-gbps`` (the application pacer in the prefill's transfer scheduler: the machine's loopback is
otherwise far faster than a datacenter link relative to this CPU's decode speed). The same
needle-in-a-haystack prompts are sent to every mode with streaming, and the client records when
each token arrives (native streaming ``/generate``: ``meta_info.completion_tokens`` of every chunk
says how many tokens it completes, so verified drafts released together are counted as tokens).

    python benchmark/serving/bench_ttkt.py --modes bf16 int8 int4 lynx-int8 --context-tokens 2048 \
        --link-gbps 0.4 --requests 5

Writes ``results/ttkt/ttkt.json``, ``ttkt.md`` and ``ttkt.png``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sglang_lynx.launch.client import StreamResult, needle_prompt, stream_chat, stream_generate
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.processes import ServerStartError
from sglang_lynx.models.prepare import prepare

KS = (1, 8, 32, 64)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_mode(model: str, mode: str, contexts: list[int], requests: int, max_tokens: int,
             link_gbps: float | None, log_dir: Path) -> list[dict[str, Any]]:
    if link_gbps:
        os.environ["SGLANG_LYNX_LINK_GBPS"] = str(link_gbps)
    # the lynx decode hooks need the non-overlap scheduler; every mode gets it so all are comparable
    args = ["--max-total-tokens", str(max(contexts) * 2 + 4096), "--disable-overlap-schedule"]
    if mode != "raw":
        args += ["--lynx", "--lynx-config", mode]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = []
    with PDDeployment(model, extra_args=args, log_dir=log_dir / mode) as dep:
        started = dep.start(timeout_s=900)
        print(f"[{mode}] deployment up in {started:.0f} s", flush=True)
        stream_chat(dep.url, needle_prompt(256, seed=999)[0], max_tokens=4)  # warm-up
        for ctx in contexts:
            for seed in range(requests):
                messages, secret = needle_prompt(ctx, seed=seed, depth=(seed % 5) / 4)
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                try:
                    res = stream_generate(dep.url, text, max_new_tokens=max_tokens)
                    error = "" if res.chunk_times else "no tokens"
                except (OSError, ValueError) as exc:  # urllib errors are OSErrors
                    res, error = StreamResult(), repr(exc)
                row = {"mode": mode, "context": ctx, "seed": seed, "tokens": len(res.chunk_times),
                       "found": secret in res.text, "prompt_tokens": res.usage.get("prompt_tokens"),
                       "error": error}
                for k in KS:
                    row[f"tt{k}t"] = res.chunk_times[k - 1] if len(res.chunk_times) >= k else None
                rows.append(row)
                tt1t = f"{row['tt1t']:.2f} s" if row["tt1t"] is not None else "-"
                print(f"[{mode}] ctx {ctx} seed {seed}: TT1T {tt1t}, tokens {row['tokens']} {error}", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for ctx in sorted({r["context"] for r in rows if r["mode"] == mode}):
            sel = [r for r in rows if r["mode"] == mode and r["context"] == ctx]
            entry: dict[str, Any] = {"mode": mode, "context": ctx, "n": len(sel),
                                     "found": sum(r["found"] for r in sel),
                                     "errors": sum(bool(r.get("error")) for r in sel)}
            for k in KS:
                vals = [r[f"tt{k}t"] for r in sel if r[f"tt{k}t"] is not None]
                entry[f"tt{k}t"] = statistics.median(vals) if vals else None
            table.append(entry)
    return table


def to_markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Machine: {meta['machine']}; commit {meta['commit']}; link: {meta['link']}",
             f"Command: `{meta['command']}`", "",
             "| mode | context | n | errors | needle found | TT1T (s) | TT8T (s) | TT32T (s) | TT64T (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        cells = [f"{e[f'tt{k}t']:.2f}" if e[f"tt{k}t"] is not None else "-" for k in KS]
        lines.append(f"| {e['mode']} | {e['context']} | {e['n']} | {e['errors']} | {e['found']}/{e['n']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(e["mode"] for e in table))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(KS)
    for i, k in enumerate(KS):
        vals = [next((e[f"tt{k}t"] or 0 for e in table if e["mode"] == m), 0) for m in modes]
        ax.bar([j + i * width for j in range(len(modes))], vals, width, label=f"TT{k}T")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes)
    ax.set_ylabel("seconds (median)")
    ax.set_title("Time to k-th token per mode (first context length)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4", "lynx-int4", "lynx-int8"])
    parser.add_argument("--context-tokens", nargs="+", type=int, default=[2048])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--link-gbps", type=float, default=0.4)
    parser.add_argument("--out", type=Path, default=Path("results/ttkt"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(prepare("smollm2-135m"))
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        try:
            rows += run_mode(model, mode, args.context_tokens, args.requests, args.max_tokens, args.link_gbps,
                             args.out / "logs")
        except ServerStartError as exc:
            print(f"[{mode}] deployment failed to start: {str(exc)[:500]}", flush=True)
    table = summarize(rows)
    meta = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, no GPU",
            "commit": _commit(), "link": f"application pacer at {args.link_gbps} Gb/s (Lynx streams)",
            "command": "python " + " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    (args.out / "ttkt.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=2))
    markdown = to_markdown(table, meta)
    (args.out / "ttkt.md").write_text(markdown)
    plot(table, args.out / "ttkt.png")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
