"""Draft quality of every codec variant on real KV of the default model, paired over many contexts.

One command::

    OMP_NUM_THREADS=2 python benchmark/codec/measure_drafts.py --contexts 100 --tokens 1024

Per context: fp32 prefill of ``tokens`` local-text tokens (transformers), reference KV = the fp32
KV rounded to bf16 (post-RoPE, as a KV pool stores it). Every variant's KV is decode(encode(ref KV))
per layer. All variants then decode greedily *in one batch* (row 0 = reference bf16 KV) for up to
``--draft`` tokens, starting from the prefill's own next token; a row's accepted length is its common
prefix with row 0 (the loop stops once every row diverged). Also per variant: relative K / V error
(mean over layers, worst layer) and attention-output error (the reference query of the first decode
step, per layer, against the quantized context K / V; mean over layers). Results: JSON in
``benchmark/codec/results/drafts-<tokens>.json`` and a Markdown section of ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))

from local_texts import build_contexts  # noqa: E402
from results_md import replace_section  # noqa: E402

from sglang_lynx.codec.layout import LayoutParams, wire_bits_per_value  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402

# (label, codec, params, with_residual). Row 0 is always the bf16 reference. Today's defaults (key chunks and
# value groups of 64 since issue 14, sink 1, alpha 0, recent_tokens 48) unless a row pins a parameter (the rows
# labelled "today" in the "groups" set are the 32 + 32 defaults of the run that chose 64 + 64); the 22-context run of
# 2026-11-29 (value groups of 64, no trailer) is in git history (results/drafts-1024-shard*of2.jsonl).
WINDOW_KEY = "window8_tokens"  # measurement only: the last R tokens coded by int8 g64 instead of the row's codec
WINDOW_CODEC = "int8"
VARIANTS: list[tuple[str, str, dict[str, Any], bool]] = [
    ("bf16 (reference)", "bf16", {}, False),
    ("int8 g64", "int8", {}, False),
    ("lynx full (lynx-int8)", "lynx", {}, True),
    ("int4 g64", "int4", {}, False),
    ("kivi-int4", "kivi-int4", {}, False),
    ("lynx anchor (lynx-int4: sink 1, alpha 0, k-chunk and v-group 64, recent 48)", "lynx", {}, False),
    ("lynx anchor recent 32", "lynx", {"recent_tokens": 32}, False),
    ("lynx anchor recent 0 (previous default)", "lynx", {"recent_tokens": 0}, False),
]
_C32_G32 = {"key_chunk_tokens": 32, "value_group_size": 32}  # lynx's groups until issue 14
_C64_G64 = {"key_chunk_tokens": 64, "value_group_size": 64}  # today's defaults
_C128_G64 = {"key_chunk_tokens": 128, "value_group_size": 64}
#: ``--variants``: named sets of rows (each needs the bf16 reference first and a kivi-int4 row).
VARIANT_SETS: dict[str, list[tuple[str, str, dict[str, Any], bool]]] = {
    "default": VARIANTS,
    # issue 14: lynx in no more bytes than int8 -- larger metadata groups (keys: tokens per channel chunk,
    # values: dims per group), anchor and full, beside today's groups of 32
    "groups": [
        ("bf16 (reference)", "bf16", {}, False),
        ("int8 g64", "int8", {}, False),
        ("kivi-int4", "kivi-int4", {}, False),
        ("lynx full, k-chunk 32 v-group 32 (today)", "lynx", _C32_G32, True),
        ("lynx anchor, k-chunk 32 v-group 32 (today)", "lynx", _C32_G32, False),
        ("lynx full, k-chunk 64 v-group 64", "lynx", _C64_G64, True),
        ("lynx anchor, k-chunk 64 v-group 64", "lynx", _C64_G64, False),
        ("lynx full, k-chunk 128 v-group 64", "lynx", _C128_G64, True),
        ("lynx anchor, k-chunk 128 v-group 64", "lynx", _C128_G64, False),
    ],
    # issue 14 item 5: KIVI as KIVI specifies it (its most recent R tokens unquantized: R = 32 / 48 / 128, sent
    # in bf16 in the anchor's trailer) beside lynx's anchor (its last 48 tokens at 8 bits in its trailer)
    "kivi": [
        ("bf16 (reference)", "bf16", {}, False),
        ("int8 g64", "int8", {}, False),
        ("kivi-int4", "kivi-int4", {}, False),
        ("kivi-int4 R32", "kivi-int4", {"kivi_recent_tokens": 32}, False),
        ("kivi-int4 R48", "kivi-int4", {"kivi_recent_tokens": 48}, False),
        ("kivi-int4 R128", "kivi-int4", {"kivi_recent_tokens": 128}, False),
        ("kivi-int2 R128", "kivi-int2", {"kivi_recent_tokens": 128}, False),
        ("lynx anchor (lynx-int4)", "lynx", {}, False),
        ("lynx full (lynx-int8)", "lynx", {}, True),
    ],
    # issue 14 item 5: the 4-bit baselines with lynx's anchor's recency at its precision -- their last 48 tokens
    # coded by int8 g64 (8.5 bits) instead of their 4-bit code, about the anchor's bits at 1K tokens
    "window": [
        ("bf16 (reference)", "bf16", {}, False),
        ("int8 g64", "int8", {}, False),
        ("kivi-int4", "kivi-int4", {}, False),
        ("kivi-int4, last 48 at int8", "kivi-int4", {WINDOW_KEY: 48}, False),
        ("int4 g64", "int4", {}, False),
        ("int4 g64, last 48 at int8", "int4", {WINDOW_KEY: 48}, False),
        ("lynx anchor (lynx-int4)", "lynx", {}, False),
        ("lynx full (lynx-int8)", "lynx", {}, True),
    ],
}


def load_model(model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return tok, model


def _fast(codec: Any) -> Any:
    """The C fast path for lynx at alpha 0 (byte-identical to the reference: tests/kernels), else None."""
    if codec.name not in ("lynx", "lynx-int4", "lynx-int8") or getattr(codec, "alpha", 0.0) != 0.0:
        return None
    from sglang_lynx.kernels import lynx_cpu_fast

    return lynx_cpu_fast


def _encode(codec: Any, x: torch.Tensor, kind: str, layer: int) -> Any:
    fast = _fast(codec)
    return codec.encode(x, kind, layer=layer) if fast is None else fast.encode(
        x, kind, params=codec.params, layer=layer, codec_name=codec.name
    )


def _decode(codec: Any, enc: Any, with_residual: bool) -> torch.Tensor:
    fast = _fast(codec)
    if fast is None:
        return codec.decode(enc, with_residual=with_residual, dtype=torch.float32)
    return fast.decode(enc, with_residual=with_residual, params=codec.params, dtype=torch.float32)


def _split_window(params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A row's codec parameters and its int8 window (``WINDOW_KEY``, 0 when absent)."""
    return {k: v for k, v in params.items() if k != WINDOW_KEY}, int(params.get(WINDOW_KEY, 0))


def quantized_kv(ref: list[tuple[torch.Tensor, torch.Tensor]], variants: list[Any]) -> list[list[Any]]:
    """Per variant, per layer (K, V) as [H, L, D] float32; encodings shared between anchor/full rows. A row
    with ``WINDOW_KEY`` = R codes its first L - R tokens with its codec and its last R with int8 g64, each part
    on its own (as if sent separately: the recent window at 8 bits, like lynx's anchor trailer)."""
    out: list[list[Any]] = [[] for _ in variants]
    cache: dict[str, Any] = {}
    for layer, (k, v) in enumerate(ref):
        for i, (_, name, params, with_residual) in enumerate(variants):
            key = f"{name}|{sorted(params.items())}"
            if key not in cache or cache[key][0] != layer:
                base, window = _split_window(params)
                parts = []  # (codec, [enc K, enc V], is the row's codec) per token range, in token order
                tokens = int(k.shape[1])
                cut = max(0, tokens - window)
                for codec_name, codec_params, lo, hi, own in ((name, base, 0, cut, True),
                                                               (WINDOW_CODEC, {}, cut, tokens, False)):
                    if hi > lo:
                        codec = get_codec(codec_name, **codec_params)
                        parts.append((codec, [_encode(codec, t[:, lo:hi].transpose(0, 1).contiguous(), kind, layer)
                                              for t, kind in ((k, "k"), (v, "v"))], own))
                cache[key] = (layer, parts)
            _, parts = cache[key]
            pair = [torch.cat([_decode(codec, encs[j], with_residual and own).transpose(0, 1)
                               for codec, encs, own in parts], dim=1) for j in range(2)]
            out[i].append(pair)
    return out


def window_bits(name: str, params: dict[str, Any], tokens: int, with_residual: bool) -> float:
    """Bits per value on the wire of a row (``wire_bits_per_value``: lynx's residual without the trailer the
    anchor already carries; runs before 2026-12-07 counted it, 8.70 for lynx full at 1K): its codec's anchor,
    + residual for a full row, over all tokens, or with an int8 window, over the first tokens - R plus
    int8's over the last R, weighted by tokens."""
    base, window = _split_window(params)
    layout = LayoutParams(**{k: v for k, v in base.items() if k != "alpha"})
    window = min(window, tokens)
    total = 0.0
    for codec_name, count, lay in ((name, tokens - window, layout), (WINDOW_CODEC, window, LayoutParams())):
        if count:
            a_bits, r_bits = wire_bits_per_value(codec_name, count, 3, 64, lay)
            total += count * (a_bits + (r_bits if with_residual else 0.0))
    return total / tokens


def attention_error(q: torch.Tensor, kv_ref: tuple[torch.Tensor, ...], kv: tuple[torch.Tensor, ...]) -> float:
    """q [Hq, D]; K/V [Hkv, L, D]: relative error of softmax(qK^T/sqrt(D))V."""

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        p = torch.softmax(torch.einsum("hd,hld->hl", q, k) / math.sqrt(q.shape[-1]), dim=-1)
        return torch.einsum("hl,hld->hd", p, v)

    ref = attend(*kv_ref)
    return float((attend(*kv) - ref).norm() / ref.norm())


def run_context(model: Any, ids: list[int], draft: int) -> dict[str, Any]:
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        cache = DynamicCache()
        out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        first = int(out.logits[0, -1].argmax())
        ref = [(layer.keys[0].to(torch.bfloat16), layer.values[0].to(torch.bfloat16)) for layer in cache.layers]
        variants_kv = quantized_kv(ref, VARIANTS)
        rows = len(VARIANTS)
        for layer_idx, layer in enumerate(cache.layers):
            layer.keys = torch.stack([variants_kv[r][layer_idx][0] for r in range(rows)])
            layer.values = torch.stack([variants_kv[r][layer_idx][1] for r in range(rows)])
        queries: dict[int, torch.Tensor] = {}

        def capture(idx: int) -> Any:
            def hook(module: Any, args: Any, kwargs: Any) -> None:
                if idx in queries:
                    return
                hidden = kwargs.get("hidden_states", args[0] if args else None)[:1]
                cos, sin = kwargs["position_embeddings"]
                q = module.q_proj(hidden).view(1, 1, -1, module.head_dim).transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos[:1], sin[:1])
                queries[idx] = q[0, :, 0]

            return hook

        hooks = [
            layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
            for i, layer in enumerate(model.model.layers)
        ]
        tokens = torch.full((rows, 1), first)
        generated: list[torch.Tensor] = []
        alive = torch.ones(rows, dtype=torch.bool)
        try:
            for _ in range(draft):
                step = model(tokens, past_key_values=cache, use_cache=True)
                for h in hooks:
                    h.remove()
                hooks = []
                nxt = step.logits[:, -1].argmax(dim=-1)
                generated.append(nxt)
                alive &= nxt == nxt[0]
                if not bool(alive[1:].any()):
                    break
                tokens = nxt.view(rows, 1)
        finally:
            for h in hooks:
                h.remove()
    gen = torch.stack(generated, dim=1)
    matches = gen == gen[:1]
    accepted = [int(m.cumprod(0).sum()) for m in matches]
    result: dict[str, Any] = {"accepted": accepted, "k_err": [], "v_err": [], "attn_err": []}
    for r in range(rows):
        ke, ve, ae = [], [], []
        for layer_idx, (k, v) in enumerate(ref):
            kq, vq = variants_kv[r][layer_idx]
            ke.append(float((kq - k.float()).norm() / k.float().norm()))
            ve.append(float((vq - v.float()).norm() / v.float().norm()))
            ae.append(attention_error(queries[layer_idx], (k.float(), v.float()), (kq, vq)))
        result["k_err"].append(ke)
        result["v_err"].append(ve)
        result["attn_err"].append(ae)
    return result


def mean_ci(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, 1.96 * sd / math.sqrt(n)


def summarise(results: list[dict[str, Any]], tokens: int, draft: int) -> list[dict[str, Any]]:
    rows = []
    kivi = [label for label, *_ in VARIANTS].index("kivi-int4")
    for r, (label, name, params, with_residual) in enumerate(VARIANTS):
        acc = [res["accepted"][r] for res in results]
        diff = [res["accepted"][r] - res["accepted"][kivi] for res in results]

        def per_layer(key: str, r: int = r) -> list[float]:
            return [sum(res[key][r][i] for res in results) / len(results) for i in range(30)]

        rows.append(
            {
                "variant": label,
                "codec": name,
                "params": params,
                "with_residual": with_residual,
                "bits_per_value": window_bits(name, params, tokens, with_residual),
                "accepted": mean_ci(acc),
                "all_accepted": sum(a == draft for a in acc) / len(acc),
                "vs_kivi_int4": mean_ci(diff),
                "k_err_mean": sum(per_layer("k_err")) / 30,
                "k_err_worst": max(per_layer("k_err")),
                "v_err_mean": sum(per_layer("v_err")) / 30,
                "v_err_worst": max(per_layer("v_err")),
                "attn_err": mean_ci([sum(res["attn_err"][r]) / 30 for res in results]),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"### Draft agreement and errors, {meta['tokens']}-token contexts ({meta['contexts']} contexts, "
        f"{meta['draft']} greedy tokens)",
        "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}` ({meta['seconds']:.0f} s).",
        "Means with 95% CI (1.96 s.e.); 'vs kivi-int4' is the paired difference in accepted tokens.",
        "",
        "| variant | bits/value | accepted of " + str(meta["draft"]) + " | all accepted | vs kivi-int4 "
        "| attn-out rel. err | K err mean / worst layer | V err mean / worst layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        acc, ci = row["accepted"]
        d, dci = row["vs_kivi_int4"]
        att, aci = row["attn_err"]
        lines.append(
            f"| {row['variant']} | {row['bits_per_value']:.3f} | {acc:.1f} ± {ci:.1f} | {row['all_accepted']:.2f} "
            f"| {d:+.1f} ± {dci:.1f} | {att:.4f} ± {aci:.4f} | {row['k_err_mean']:.4f} / {row['k_err_worst']:.4f} "
            f"| {row['v_err_mean']:.4f} / {row['v_err_worst']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--draft", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--from-jsonl", nargs="+", help="summarise the per-context lines of earlier (partial) runs")
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th context starting at i (parallel runs)")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first N contexts (an earlier run measured them; the list is the same "
                             "for a larger --contexts): extends a run, into <name>-from<N>-shard*.jsonl")
    parser.add_argument("--name", help="results name (default drafts-<tokens>): files and RESULTS.md section")
    parser.add_argument("--variants", choices=sorted(VARIANT_SETS), default="default",
                        help="which rows to measure (VARIANT_SETS)")
    args = parser.parse_args()
    VARIANTS[:] = list(VARIANT_SETS[args.variants])
    torch.manual_seed(args.seed)
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    results: list[dict[str, Any]] = []
    start = time.time()
    if args.from_jsonl:
        for name in args.from_jsonl:
            results += [json.loads(line) for line in Path(name).read_text().splitlines() if line.strip()]
        contexts: list[tuple[str, list[int]]] = []
    else:
        tok, model = load_model(args.model_dir)
        index, count = (int(part) for part in args.shard.split("/"))
        contexts = build_contexts(tok, args.contexts, args.tokens, args.seed)[args.skip :][index::count]
    name = args.name or f"drafts-{args.tokens}"
    part = f"-from{args.skip}" if args.skip else ""
    jsonl = out_dir / f"{name}{part}-shard{args.shard.replace('/', 'of')}.jsonl"
    if contexts and not args.no_write:
        jsonl.write_text("")
    for i, (path, ids) in enumerate(contexts):
        res = run_context(model, ids, args.draft)
        res["source"] = path
        results.append(res)
        if not args.no_write:
            with jsonl.open("a") as handle:
                handle.write(json.dumps(res) + "\n")
        print(
            f"[{i + 1}/{len(contexts)}] {time.time() - start:.0f}s {path}: "
            + " ".join(str(a) for a in res["accepted"]),
            flush=True,
        )
    meta = {
        "tokens": args.tokens,
        "contexts": len(results),
        "draft": args.draft,
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "command": "python " + " ".join(sys.argv),
        "seconds": time.time() - start,
    }
    rows = summarise(results, args.tokens, args.draft)
    table = markdown(rows, meta)
    print(table)
    if not args.no_write:
        (out_dir / f"{name}.json").write_text(
            json.dumps({"meta": meta, "summary": rows, "per_context": results}, indent=1)
        )
        replace_section(HERE / "RESULTS.md", name, table)


if __name__ == "__main__":
    main()
