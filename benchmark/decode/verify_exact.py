"""The bf16 chain verify with each GEMM policy: ``rows`` (the row kernel, with the chain attention kernel: the
servers' default) and ``split`` (1-row GEMMs, one SDPA call per input), both exact, against ``batched``
(SGLang's n-row GEMMs, per-input SDPA calls): equality with plain lynx-int8 decoding and the verify's cost in
decode steps, per draft count.

Usage: OMP_NUM_THREADS=1 python benchmark/decode/verify_exact.py [--prompts 28] [--drafts 1 2 5 9 16 33 64]
       [--out benchmark/decode/results/verify_bf16_exact.json]
Runs ``tests/decode/verify_bf16_worker.py`` (in-process SGLang ModelRunner, bf16, torch_native, the real
lynx codec; see its docstring for the procedure) and prints one table: per draft count, cases, drafts
accepted, cases whose kept KV / logits / released tokens equal plain decoding, and the verify time
in decode steps of the same prompt, for each policy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.provenance import provenance  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "tests" / "decode" / "verify_bf16_worker.py"
ATTENTION = {"rows": "kernel", "split": "per-input", "batched": "per-input"}  # the worker's attention per policy


def table(cases: list[dict], by_length: bool = False) -> list[dict]:
    """One row per draft count (and prompt length when ``by_length``) and GEMM policy."""
    rows = []
    by_k: dict[tuple[int, int | None], list[dict]] = defaultdict(list)
    for case in cases:
        by_k[(case["drafts"], case["prompt_tokens"] if by_length else None)].append(case)
    for key in sorted(by_k, key=lambda kl: (kl[0], kl[1] or 0)):
        k, length = key
        group = by_k[key]
        for policy in ("rows", "split", "batched"):
            if policy not in group[0]:
                continue
            runs = [c[policy] for c in group]
            steps = sorted(r["verify_in_decode_steps"] for r in runs)
            rows.append({"drafts": k, **({"prompt_tokens": length} if by_length else {}), "policy": policy,
                         "cases": len(runs),
                         "accepted": sum(r["accepted"] for r in runs),
                         "kv_equal": sum(r["kv_equal"] for r in runs),
                         "logits_equal": sum(r["logits_equal"] for r in runs),
                         "released_equal": sum(r["released_equal"] for r in runs),
                         "verify_decode_steps_median": steps[len(steps) // 2]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--prompts", type=int, default=28)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 5, 9, 16, 33, 64])
    parser.add_argument("--max-len", type=int, default=900)
    parser.add_argument("--lengths", type=int, nargs="*", default=None,
                        help="prompt lengths in turn (default: drawn from 16..max-len); the table splits by length")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    prov = provenance()
    cmd = [sys.executable, str(WORKER), "--model-dir", args.model_dir, "--prompts", str(args.prompts),
           "--drafts", *map(str, args.drafts), "--max-len", str(args.max_len), "--compare-batched",
           *(["--lengths", *map(str, args.lengths)] if args.lengths else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    cases, summary = lines[:-1], lines[-1]
    rows = table(cases, by_length=bool(args.lengths))
    print("| drafts | prompt tokens | GEMMs (attention) | cases | accepted | kept KV equal | logits equal "
          "| released equal | verify (decode steps, median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        length = r.get("prompt_tokens", f"16-{args.max_len}")
        how = f"{r['policy']} ({ATTENTION[r['policy']] if summary.get('attention_kernel') else 'per-input'})"
        print(f"| {r['drafts']} | {length} | {how} | {r['cases']} | {r['accepted']} | "
              f"{r['kv_equal']}/{r['cases']} | {r['logits_equal']}/{r['cases']} | {r['released_equal']}/{r['cases']} | "
              f"{r['verify_decode_steps_median']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": prov, "settings": vars(args), "rows": rows,
                                              "summary": summary, "cases": cases}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
