"""Screen candidate anchor levers before they go into the codec: attention error and greedy drafts, paired.

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/anchor_screen.py --contexts 8 --tokens 1024 --drafts

Each lever is a function of one layer's reference (bf16) K and V that returns the K / V the draft would
see. Most are built from the real codecs (``get_codec``) plus a transform around them, so a lever can be
tried without changing the byte format:

* ``had-v`` / ``had-k``: each head's value (key) vectors are multiplied by the orthonormal 64 x 64
  Hadamard matrix (Sylvester order, scaled 1/8) before encoding and by it again after decoding.
* ``recent R``: the last R tokens decode with the residual (the full 8-bit code), as if their residual
  nibbles travelled in the anchor stream (4 R / T extra bits per value).

Per context: the attention-output error of the last ``--queries`` queries of every layer (as in
``lever_study.py``) and, with ``--drafts``, the greedy draft agreement of ``measure_drafts.run_context``
(all variants in one batch, row 0 = bf16 reference). Results: per-context JSON lines in
``benchmark/codec/results/screen-<tokens>.jsonl`` and a table on stdout (paired vs ``kivi-int4``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))

import measure_drafts  # noqa: E402
from lever_study import causal_attention, prefill  # noqa: E402
from local_texts import build_contexts  # noqa: E402
from measure_drafts import load_model, mean_ci  # noqa: E402

from sglang_lynx.codec.layout import LayoutParams, bits_per_value  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402

Quant = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def hadamard(dim: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / dim**0.5


def codec_variant(
    name: str, params: dict[str, Any], *, residual: bool = False, rot_k: bool = False, rot_v: bool = False,
    recent: int = 0,
) -> Quant:
    codec = get_codec(name, **params)

    def run(k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for x, kind, rot in ((k, "k", rot_k), (v, "v", rot_v)):
            h = hadamard(x.shape[-1])
            xin = (x.float() @ h).to(torch.bfloat16) if rot else x
            enc = codec.encode(xin, kind, layer=layer)
            y = codec.decode(enc, with_residual=residual, dtype=torch.float32)
            if recent:
                full = codec.decode(enc, with_residual=True, dtype=torch.float32)
                y[-recent:] = full[-recent:]
            out.append(y @ h if rot else y)
        return out[0], out[1]

    return run


def bits(name: str, params: dict[str, Any], tokens: int, residual: bool = False, recent: int = 0) -> float:
    layout = LayoutParams(**{k: v for k, v in params.items() if k != "alpha"})
    a, r = bits_per_value(name, tokens, 3, 64, layout)
    return a + (r if residual else 0.0) + 4.0 * recent / tokens


def variants(tokens: int) -> list[tuple[str, float, Quant]]:
    lx: dict[str, Any] = {}
    rows: list[tuple[str, float, Quant]] = [
        ("bf16 (reference)", 16.0, codec_variant("bf16", {})),
        ("kivi-int4", bits("kivi-int4", {}, tokens), codec_variant("kivi-int4", {})),
        ("lynx anchor (vg32)", bits("lynx", lx, tokens), codec_variant("lynx", lx)),
        ("lynx had-v", bits("lynx", lx, tokens), codec_variant("lynx", lx, rot_v=True)),
        ("lynx had-v vg64", bits("lynx", {"value_group_size": 64}, tokens),
         codec_variant("lynx", {"value_group_size": 64}, rot_v=True)),
        ("lynx had-k had-v", bits("lynx", lx, tokens), codec_variant("lynx", lx, rot_k=True, rot_v=True)),
        ("lynx recent 32", bits("lynx", lx, tokens, recent=32), codec_variant("lynx", lx, recent=32)),
        ("lynx had-v recent 32", bits("lynx", lx, tokens, recent=32),
         codec_variant("lynx", lx, rot_v=True, recent=32)),
        ("lynx had-v recent 48", bits("lynx", lx, tokens, recent=48),
         codec_variant("lynx", lx, rot_v=True, recent=48)),
        ("lynx had-v sink 4", bits("lynx", {"sink_tokens": 4}, tokens),
         codec_variant("lynx", {"sink_tokens": 4}, rot_v=True)),
        ("lynx had-v alpha 1", bits("lynx", lx, tokens), codec_variant("lynx", {"alpha": 1.0}, rot_v=True)),
        ("lynx had-v k-chunk 16 (over budget)", bits("lynx", {"chunk_tokens": 16}, tokens),
         codec_variant("lynx", {"chunk_tokens": 16}, rot_v=True)),
        ("lynx had-v vg16 (over budget)", bits("lynx", {"value_group_size": 16}, tokens),
         codec_variant("lynx", {"value_group_size": 16}, rot_v=True)),
        *[
            (f"lynx recent {r}", bits("lynx", lx, tokens, recent=r), codec_variant("lynx", lx, recent=r))
            for r in (16, 48, 64)
        ],
        *[
            (f"lynx vg64 recent {r}", bits("lynx", {"value_group_size": 64}, tokens, recent=r),
             codec_variant("lynx", {"value_group_size": 64}, recent=r))
            for r in (64, 96, 112)
        ],
        ("int8 g64", bits("int8", {}, tokens), codec_variant("int8", {})),
        ("lynx full (lynx-int8)", bits("lynx", lx, tokens, residual=True), codec_variant("lynx", lx, residual=True)),
        ("lynx full had-v", bits("lynx", lx, tokens, residual=True),
         codec_variant("lynx", lx, residual=True, rot_v=True)),
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--draft", type=int, default=64)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--drafts", action="store_true", help="also greedy drafts (slower)")
    parser.add_argument("--only", nargs="*", help="variant labels to keep (bf16 and kivi-int4 always)")
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    args = parser.parse_args()
    tok, model = load_model(args.model_dir)
    rows = variants(args.tokens)
    if args.only:
        rows = [r for r in rows if r[0] in ("bf16 (reference)", "kivi-int4", *args.only)]
    labels = [r[0] for r in rows]
    kivi = labels.index("kivi-int4")
    out = HERE / "results" / f"screen-{args.tokens}.jsonl"
    out.parent.mkdir(exist_ok=True)
    out.write_text("")
    results: list[dict[str, Any]] = []
    start = time.time()

    def quantized(ref: list[tuple[torch.Tensor, torch.Tensor]], _: Any) -> list[list[Any]]:
        per: list[list[Any]] = [[] for _ in rows]
        for layer, (k, v) in enumerate(ref):
            kt, vt = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            for i, (_, _, fn) in enumerate(rows):
                kq, vq = fn(kt, vt, layer)
                per[i].append([kq.transpose(0, 1).contiguous(), vq.transpose(0, 1).contiguous()])
        return per

    current: list[list[list[Any]]] = []
    measure_drafts.quantized_kv = lambda ref, _: current[0]  # type: ignore[assignment]  # this context's, below
    measure_drafts.VARIANTS = [(label, "", {}, False) for label in labels]
    for c, (path, ids) in enumerate(build_contexts(tok, args.contexts, args.tokens, args.seed)):
        ref, queries = prefill(model, ids, args.queries)
        kv = quantized(ref, None)
        current[:] = [kv]  # the draft prefill is the same deterministic fp32 pass: reuse its quantized KV
        attn = []
        for i in range(len(rows)):
            per_layer = []
            for layer, (k, v) in enumerate(ref):
                exact = causal_attention(queries[layer], k.float(), v.float())
                approx = causal_attention(queries[layer], kv[i][layer][0], kv[i][layer][1])
                per_layer.append(float((approx - exact).norm() / exact.norm()))
            attn.append(sum(per_layer) / len(per_layer))
        res: dict[str, Any] = {"source": path, "attn": attn}
        if args.drafts:
            res["accepted"] = measure_drafts.run_context(model, ids, args.draft)["accepted"]
        results.append(res)
        with out.open("a") as handle:
            handle.write(json.dumps(res) + "\n")
        print(f"[{c + 1}/{args.contexts}] {time.time() - start:.0f}s {path} {res.get('accepted', '')}", flush=True)
    print(f"\n{len(results)} contexts x {args.tokens} tokens, seed {args.seed}; paired vs kivi-int4 (95% CI)\n")
    print("| variant | bits/value | attn err | vs kivi | accepted | vs kivi |")
    print("|---|---|---|---|---|---|")
    for i, (label, b, _) in enumerate(rows):
        a, aci = mean_ci([r["attn"][i] for r in results])
        d, dci = mean_ci([r["attn"][i] - r["attn"][kivi] for r in results])
        line = f"| {label} | {b:.3f} | {a:.4f} ± {aci:.4f} | {d:+.4f} ± {dci:.4f} |"
        if args.drafts:
            m, mci = mean_ci([float(r["accepted"][i]) for r in results])
            e, eci = mean_ci([float(r["accepted"][i] - r["accepted"][kivi]) for r in results])
            line += f" {m:.1f} ± {mci:.1f} | {e:+.1f} ± {eci:.1f} |"
        else:
            line += " - | - |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
