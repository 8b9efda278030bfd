"""The verify's row GEMM kernel (``kernels/lynx_rows_gemm``) against torch's 1-row and batched bf16 GEMMs.

One command (CPU)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/kernels/bench_rows_gemm.py --rows 16

For each weight shape of the default model (qkv, o, gate_up, down, the tied LM head), random bf16 weights
and ``--rows`` random rows: milliseconds (best of ``--repeats``) of ``rows`` (the kernel, weights packed
beforehand as the decode server packs them once), ``split`` (one torch 1-row GEMM per row: what the
verify ran before, and what a decode step computes per row), ``one_row`` (a single 1-row GEMM: a decode
step's GEMM) and ``batched`` (one torch n-row GEMM: fewer weight reads, not row-exact here), and whether
every row of ``rows`` and of ``batched`` equals ``split`` bit for bit. Writes
``results/rows_gemm-cpu.json`` (``--out`` to change).
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
from benchmark.codec.throughput import best_seconds  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from sglang_lynx.kernels import lynx_rows_gemm as rg  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return round(best_seconds(fn, repeats) * 1e3, 4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def measure(name: str, n: int, k: int, rows: int, repeats: int, g: torch.Generator) -> dict[str, object]:
    linear = torch.nn.functional.linear
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    chunk = rg.calibrate(n, k, linear)
    if chunk is None:
        raise SystemExit(f"{name} [{n} x {k}]: no chunk length reproduces this host's 1-row GEMM")
    packed = rg.pack(w)
    split = rg.one_row_each(linear, x, w)
    row = {"weight": name, "n": n, "k": k, "rows": rows, "chunk": chunk,
           "rows_ms": best_ms(lambda: rg.gemm(x, packed, n, chunk), repeats),
           "split_ms": best_ms(lambda: rg.one_row_each(linear, x, w), repeats),
           "one_row_ms": best_ms(lambda: linear(x[:1], w), repeats),
           "batched_ms": best_ms(lambda: linear(x, w), repeats),
           "rows_equal_split": bool(torch.equal(_bits(rg.gemm(x, packed, n, chunk)), _bits(split))),
           "batched_rows_equal_split": int((_bits(linear(x, w)) == _bits(split)).all(dim=1).sum())}
    print(f"{name:8s} [{n:6d} x {k:5d}] rows {row['rows_ms']:8.3f} ms  split {row['split_ms']:8.3f} ms  "
          f"one row {row['one_row_ms']:7.3f} ms  batched {row['batched_ms']:7.3f} ms  "
          f"rows exact {row['rows_equal_split']}  batched rows exact {row['batched_rows_equal_split']}/{rows}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rows_gemm-cpu.json"))
    args = parser.parse_args()
    prov = provenance()
    rg.build()
    if not rg.available():
        raise SystemExit("the row GEMM kernel needs AVX512-BF16, which this CPU build does not have")
    g = torch.Generator().manual_seed(0)
    rows_out = [measure(name, n, k, args.rows, args.repeats, g) for name, (n, k) in SHAPES.items()]
    keys = ("rows_ms", "split_ms", "one_row_ms", "batched_ms")
    total = {key: round(sum(r[key] for r in rows_out), 3) for key in keys}
    print(f"one layer's four GEMMs + LM head: {total}")
    Path(args.out).write_text(json.dumps({"provenance": prov, "settings": vars(args), "shapes": rows_out,
                                          "total": total, "threads": torch.get_num_threads()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
