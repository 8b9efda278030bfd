"""Which anchor levers pay: attention-output error of many codec variants on real KV (cheap proxy).

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/lever_study.py --contexts 6 --tokens 1024

Per context: fp32 prefill (transformers), reference KV = fp32 KV rounded to bf16; the post-RoPE queries
of the last ``--queries`` positions of every layer are captured. For every variant, per layer: causal
attention of those queries over the reference vs the decode(encode()) context K/V; the relative error
of the attention output, averaged over layers, then over contexts (95% CI, paired across variants).
Greedy draft agreement (the real target) is in ``measure_drafts.py``; this study only ranks levers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))

from local_texts import build_contexts  # noqa: E402
from measure_drafts import load_model, mean_ci  # noqa: E402
from results_md import replace_section  # noqa: E402

from sglang_lynx.codec.layout import LayoutParams, bits_per_value  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402

# Rows as in the recorded run: then, lynx's value groups were 64 wide ("default" below); the run's
# "v-group 32" row is today's default (value_group_size=32).
LEVERS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("int4 g64", "int4", {}, False),
    ("kivi-int4", "kivi-int4", {}, False),
    ("lynx-paper anchor alpha=3", "lynx-paper", {"alpha": 3.0}, False),
    ("lynx-paper anchor alpha=0", "lynx-paper", {"alpha": 0.0}, False),
    ("lynx anchor sink=0", "lynx", {"sink_tokens": 0, "value_group_size": 64}, False),
    ("lynx anchor sink=1 (default)", "lynx", {"value_group_size": 64}, False),
    ("lynx anchor sink=4", "lynx", {"sink_tokens": 4, "value_group_size": 64}, False),
    ("lynx anchor alpha=1", "lynx", {"alpha": 1.0, "value_group_size": 64}, False),
    ("lynx anchor alpha=3", "lynx", {"alpha": 3.0, "value_group_size": 64}, False),
    ("lynx anchor v-group 32", "lynx", {"value_group_size": 32}, False),
    ("lynx anchor k-chunk 16", "lynx", {"chunk_tokens": 16, "value_group_size": 64}, False),
    ("lynx anchor k-chunk 64", "lynx", {"chunk_tokens": 64, "value_group_size": 64}, False),
    ("int8 g64", "int8", {}, False),
    ("lynx full (lynx-int8)", "lynx", {"value_group_size": 64}, True),
    ("lynx-paper full alpha=3", "lynx-paper", {"alpha": 3.0}, True),
]


def prefill(
    model: Any, ids: list[int], queries: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    captured: dict[int, torch.Tensor] = {}

    def capture(idx: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)[:, -queries:]
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(hidden).view(1, queries, -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos[:, -queries:], sin[:, -queries:])
            captured[idx] = q[0]  # [Hq, Q, D]

        return hook

    hooks = [
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            cache = DynamicCache()
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    ref = [(layer.keys[0].to(torch.bfloat16), layer.values[0].to(torch.bfloat16)) for layer in cache.layers]
    return ref, [captured[i] for i in range(len(ref))]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, Q, D] for the last Q positions; k/v [Hkv, L, D]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = torch.einsum("hqd,hld->hql", q, k) / math.sqrt(q.shape[-1])
    length, nq = k.shape[1], q.shape[1]
    positions = torch.arange(length - nq, length).view(nq, 1)
    scores = scores.masked_fill(torch.arange(length).view(1, length) > positions, float("-inf"))
    return torch.einsum("hql,hld->hqd", torch.softmax(scores, dim=-1), v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tok, model = load_model(args.model_dir)
    start = time.time()
    errors: list[list[float]] = [[] for _ in LEVERS]
    for c, (path, ids) in enumerate(build_contexts(tok, args.contexts, args.tokens, args.seed)):
        ref, queries = prefill(model, ids, args.queries)
        for i, (_, name, params, with_residual) in enumerate(LEVERS):
            codec = get_codec(name, **params)
            per_layer = []
            for layer, (k, v) in enumerate(ref):
                kq, vq = (
                    codec.decode(
                        codec.encode(t.transpose(0, 1), kind, layer=layer),
                        with_residual=with_residual,
                        dtype=torch.float32,
                    ).transpose(0, 1)
                    for t, kind in ((k, "k"), (v, "v"))
                )
                exact = causal_attention(queries[layer], k.float(), v.float())
                approx = causal_attention(queries[layer], kq, vq)
                per_layer.append(float((approx - exact).norm() / exact.norm()))
            errors[i].append(sum(per_layer) / len(per_layer))
        print(f"[{c + 1}/{args.contexts}] {time.time() - start:.0f}s {path}", flush=True)
    lines = [
        f"### Lever study: attention-output error ({args.contexts} contexts x {args.tokens} tokens, last "
        f"{args.queries} queries of every layer, causal)",
        "",
        f"Command: `python {' '.join(sys.argv)}` ({time.time() - start:.0f} s, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)). Paired vs the default lynx anchor: mean difference ± 95% CI.",
        "",
        "| variant | bits/value | attn-out rel. err | vs lynx anchor default |",
        "|---|---|---|---|",
    ]
    default = [label for label, *_ in LEVERS].index("lynx anchor sink=1 (default)")
    rows = []
    for i, (label, name, params, with_residual) in enumerate(LEVERS):
        layout = LayoutParams(**{k: v for k, v in params.items() if k != "alpha"})
        a_bits, r_bits = bits_per_value(name, args.tokens, 3, 64, layout)
        bits = a_bits + (r_bits if with_residual else 0.0)
        err, ci = mean_ci(errors[i])
        diff, dci = mean_ci([e - d for e, d in zip(errors[i], errors[default], strict=True)])
        rows.append({"variant": label, "bits": bits, "attn_err": errors[i]})
        lines.append(f"| {label} | {bits:.3f} | {err:.4f} ± {ci:.4f} | {diff:+.4f} ± {dci:.4f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_write:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "levers.json").write_text(json.dumps(rows, indent=1))
        replace_section(HERE / "RESULTS.md", "levers", table)


if __name__ == "__main__":
    main()
