"""The chain attention kernel (``kernels/lynx_chain_sdpa``) against the per-input torch SDPA loop it replaces.

One command (CPU)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/kernels/bench_chain_sdpa.py

For each prefix length S (``--lengths``), ``--drafts`` chain inputs with the default model's attention
(9 query heads, 3 KV heads, D = 64, scale 1/8), random bf16 q/k/v: median milliseconds over ``--repeats``
of ``kernel`` (all inputs in one pass over K/V, ``--threads`` threads of the kernel's own split), ``loop``
(one torch SDPA call per input: what ``chain_sdpa_decode`` runs, and what each decode step computes) and
``one_step`` (a single SDPA call of the last input: one decode step's attention), and how many of the
n x H x D outputs of ``kernel`` equal ``loop``'s bit for bit. Writes ``results/chain_sdpa-cpu.json``
(``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from benchmark.timing import median_seconds  # noqa: E402
from sglang_lynx.kernels import lynx_chain_sdpa as cs  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, SCALE = 9, 3, 64, 0.125


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return round(median_seconds(fn, repeats) * 1e3, 4)


def measure(prefix_len: int, n: int, repeats: int, threads: int) -> dict[str, object]:
    q, k, v = cs.check_inputs("random", n, prefix_len, HEADS, KV_HEADS, HEAD_DIM, seed=prefix_len)
    last_q = q[-1:].movedim(0, 1).unsqueeze(0)
    keys, values = k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0)
    got = cs.chain_sdpa(q, k, v, prefix_len, SCALE, threads=threads)
    want = cs.per_input_sdpa(q, k, v, prefix_len, SCALE)
    row = {"prefix_len": prefix_len, "drafts": n, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "kernel_ms": median_ms(lambda: cs.chain_sdpa(q, k, v, prefix_len, SCALE, threads=threads), repeats),
           "loop_ms": median_ms(lambda: cs.per_input_sdpa(q, k, v, prefix_len, SCALE), repeats),
           "one_step_ms": median_ms(lambda: scaled_dot_product_attention(last_q, keys, values, enable_gqa=True,
                                                                         scale=SCALE), repeats),
           "outputs": got.numel(),
           "outputs_equal": int((got.view(torch.int16) == want.view(torch.int16)).sum())}  # fmt: skip
    print(f"S={prefix_len:5d} n={n:3d}: kernel {row['kernel_ms']:7.3f} ms  loop {row['loop_ms']:8.3f} ms  "
          f"one step {row['one_step_ms']:6.3f} ms  equal outputs {row['outputs_equal']}/{row['outputs']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[1400, 5600])
    parser.add_argument("--drafts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1, help="the kernel's threads (torch's: OMP_NUM_THREADS)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chain_sdpa-cpu.json"))
    args = parser.parse_args()
    prov = provenance()
    cs.build()
    if not cs.available():
        raise SystemExit("the chain attention kernel needs AVX-512 F/BW, which this CPU build does not have")
    rows = [measure(s, args.drafts, args.repeats, args.threads) for s in args.lengths]
    Path(args.out).write_text(json.dumps({"provenance": prov, "settings": vars(args), "torch_threads":
                                          torch.get_num_threads(), "self_check": cs.matches_torch(args.threads),
                                          "lengths": rows}, indent=1))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
