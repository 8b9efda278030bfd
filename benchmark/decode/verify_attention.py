"""What the exact verify's attention costs on the CPU backend, and what one batched call would cost.

The exact chain verify (``integration/decode/chain_attention.py``) gives each of its ``n`` inputs the
same ``scaled_dot_product_attention`` call a decode step makes (one query, the row's first ``S + i + 1``
keys, ``enable_gqa``), so that every input rounds as its decode step does. This measures, per layer, on
random bf16 K/V of the default model's shape (9 query heads, 3 KV heads, head dim 64; the values do not
change the cost): one such call (= a decode step's attention), the ``n`` calls of a verify, and ONE call
with all ``n`` queries and a causal mask over ``S + n`` keys (what a batched verify would make), with the
number of rows the batched call rounds exactly as the per-row call (random data; not a proof either way).

Usage: OMP_NUM_THREADS=1 python benchmark/decode/verify_attention.py [--lengths 1400 5600] [--drafts 16]
       [--layers 30] [--out benchmark/decode/results/verify_attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmark.codec.throughput import best_seconds  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return best_seconds(fn, repeats) * 1e3


def measure(prefix: int, n: int, repeats: int, seed: int) -> dict[str, float | int]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(prefix + n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16().movedim(0, 1).unsqueeze(0)
    v = torch.randn(prefix + n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16().movedim(0, 1).unsqueeze(0)
    q = torch.randn(1, Q_HEADS, n, HEAD_DIM, generator=gen).bfloat16()
    scale = HEAD_DIM**-0.5

    def row(i: int) -> torch.Tensor:
        length = prefix + i + 1
        return sdpa(q[:, :, i : i + 1], k[:, :, :length], v[:, :, :length], enable_gqa=True, scale=scale)

    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    batched = lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)  # noqa: E731
    one_ms = best_ms(lambda: row(0), repeats)
    rows_ms = best_ms(lambda: [row(i) for i in range(n)], max(1, repeats // 4))
    batched_ms = best_ms(batched, repeats)
    together = batched()
    equal = sum(bool(torch.equal(together[:, :, i : i + 1], row(i))) for i in range(n))
    return {"prefix_tokens": prefix, "inputs": n, "one_call_ms": one_ms, "per_row_calls_ms": rows_ms,
            "batched_call_ms": batched_ms, "batched_rows_equal": equal}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1400, 5600])
    parser.add_argument("--drafts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    prov = provenance()
    rows = []
    for prefix in args.lengths:
        m = measure(prefix, args.drafts, args.repeats, seed=prefix)
        m |= {f"{key}_all_layers": m[f"{key}_ms"] * args.layers / 1e3 for key in ("one_call", "per_row_calls",
                                                                                 "batched_call")}  # fmt: skip
        rows.append(m)
        print(f"S={prefix} n={args.drafts}: one call {m['one_call_ms']:.2f} ms (x{args.layers} layers "
              f"{m['one_call_all_layers']:.3f} s = a decode step's attention), {args.drafts} per-row calls "
              f"{m['per_row_calls_ms']:.1f} ms ({m['per_row_calls_all_layers']:.2f} s), one {args.drafts}-query "
              f"call {m['batched_call_ms']:.2f} ms ({m['batched_call_all_layers']:.3f} s); batched rows equal to "
              f"per-row: {m['batched_rows_equal']}/{args.drafts}", flush=True)  # fmt: skip
    if args.out:
        result = {"provenance": prov, "layers": args.layers, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
