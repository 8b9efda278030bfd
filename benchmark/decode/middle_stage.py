"""lynx-exact's middle stage, measured (issue 15 item 3): when the residual lands before the exact stream,
keep the anchor-made drafts and draft on from them on the 8-bit KV (A, what the servers do), or first
verify the anchor-made drafts against the 8-bit KV and draft on from the agreeing prefix and its
correction (B)?

Timeline of one case (bf16, the real model, SGLang's own kernels, in process; ``tests/decode`` harness):
``a`` draft steps on the anchor-only prompt KV; the residual lands; ``b`` decode-step times pass before the
exact stream lands; one verify against the exact (prefill) KV then releases the agreeing prefix and the
correction. A: the prompt KV upgraded to the 8-bit reconstruction, ``b`` more drafts from the anchor path.
B: upgraded, one chain verify of the ``a`` drafts on the 8-bit KV, whose time counts as ``c`` decode steps
(its wall time over the same prompt's decode step, rounded up), then ``b - c`` drafts from there. Every
draft step and verify is ``decode.verify.chain_verify_logits`` (bit-identical to SGLang's decode step on
this backend: ``tests/decode/test_verify_bf16_exact.py``), so the tokens released are compared with
greedy decoding on the exact KV as well (they must be its prefix).

Usage: OMP_NUM_THREADS=1 python benchmark/decode/middle_stage.py [--prompts 12] [--lengths 1024]
       [--prompt-kind needle|code]
       [--stages 16:8 32:16] [--out benchmark/decode/results/middle_stage.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "decode"))

import torch  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402


def _greedy_drafts(runner, row: int, position: int, token: int, steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    """``steps`` greedy tokens after ``token`` at ``position`` on whatever KV the row holds (decode steps)."""
    from sglang_lynx.integration.decode.verify import chain_verify_logits

    out = []
    for i in range(steps):
        token = int(chain_verify_logits(runner, row, position + i, [token])[0].argmax())
        out.append(token)
    return out


def _verify(runner, row: int, prompt_len: int, t0: int, drafts: list[int]) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    """(emitted tokens, accepted drafts) of one greedy chain verify of ``drafts`` on the row's KV."""
    from sglang_lynx.decode.speculative import greedy_chain_accept
    from sglang_lynx.integration.decode.verify import chain_verify_logits

    if not drafts:
        return [], 0
    logits = chain_verify_logits(runner, row, prompt_len, [t0, *drafts[:-1]])
    verdict = greedy_chain_accept(torch.tensor(drafts), logits, 0.0)
    return verdict.emitted(drafts), verdict.num_accepted


def run_prompt(runner, wrapper, prompt: list[int], stages: list[tuple[int, int]]) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every stage ``(a, b)`` of one prompt (one prefill, reconstructions and reference shared)."""
    from model_runner_harness import decode_steps, prefill
    from verify_experiment import prefix_slots, reconstruct_prefix, write_prefix

    length = len(prompt)
    t0, batch, _ = prefill(wrapper, prompt)
    slots = prefix_slots(runner, batch, length)
    pool = runner.token_to_kv_pool
    layers = range(len(pool.k_buffer))
    exact = [(pool.k_buffer[i][slots].clone(), pool.v_buffer[i][slots].clone()) for i in layers]
    full8 = reconstruct_prefix(runner, slots, with_residual=True)
    anchor = reconstruct_prefix(runner, slots, with_residual=False)
    steps = max(a + b for a, b in stages) + 1
    started = time.perf_counter()
    reference, _ = decode_steps(wrapper, batch, t0, steps)  # on the exact KV; allocates the row's slots
    decode_s = (time.perf_counter() - started) / steps
    row = int(batch.req_pool_indices[0])
    cases = []
    for a, b in stages:
        draft_slots = runner.req_to_token_pool.req_to_token[row, length: length + a].to(torch.int64)
        write_prefix(runner, slots, anchor)
        anchor_drafts = _greedy_drafts(runner, row, length, t0, a)
        anchor_kv = [(pool.k_buffer[i][draft_slots].clone(), pool.v_buffer[i][draft_slots].clone()) for i in layers]

        # A: upgrade to the 8-bit KV and draft on from the anchor path
        write_prefix(runner, slots, full8)
        path_a = anchor_drafts + _greedy_drafts(runner, row, length + a, anchor_drafts[-1], b)
        write_prefix(runner, slots, exact)
        released_a, accepted_a = _verify(runner, row, length, t0, path_a)

        # B: upgrade, verify the anchor drafts on the 8-bit KV, draft on from its verdict
        write_prefix(runner, draft_slots, anchor_kv)
        write_prefix(runner, slots, full8)
        started = time.perf_counter()
        checked, agreed = _verify(runner, row, length, t0, anchor_drafts)
        cost = math.ceil((time.perf_counter() - started) / decode_s)
        more = max(0, b - cost)
        path_b = checked + (_greedy_drafts(runner, row, length + len(checked), checked[-1], more) if more else [])
        write_prefix(runner, slots, exact)
        released_b, accepted_b = _verify(runner, row, length, t0, path_b)
        cases.append({
            "prompt_tokens": length, "a": a, "b": b, "verify_8bit_steps": cost,
            "anchor_drafts_agreeing_8bit": agreed,
            "A": {"drafts": len(path_a), "accepted": accepted_a, "released": len(released_a),
                  "equal_to_exact_greedy": released_a == reference[: len(released_a)]},
            "B": {"drafts": len(path_b), "accepted": accepted_b, "released": len(released_b),
                  "equal_to_exact_greedy": released_b == reference[: len(released_b)]},
        })  # fmt: skip
    return cases


def summarize(cases: list[dict]) -> list[dict]:
    rows = []
    for a, b in dict.fromkeys((c["a"], c["b"]) for c in cases):
        sel = [c for c in cases if (c["a"], c["b"]) == (a, b)]
        diffs = [c["B"]["released"] - c["A"]["released"] for c in sel]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        rows.append({"a": a, "b": b, "cases": len(sel),
                     "released_A_mean": statistics.mean(c["A"]["released"] for c in sel),
                     "released_B_mean": statistics.mean(c["B"]["released"] for c in sel),
                     "B_minus_A_mean": statistics.mean(diffs), "B_minus_A_ci95": 1.96 * sd / math.sqrt(len(diffs)),
                     "B_better": sum(d > 0 for d in diffs), "B_worse": sum(d < 0 for d in diffs),
                     "verify_8bit_steps_median": statistics.median(c["verify_8bit_steps"] for c in sel),
                     "all_equal_to_exact_greedy": all(c[k]["equal_to_exact_greedy"] for c in sel for k in "AB")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--stages", nargs="+", default=["16:8", "32:16"], help="a:b draft steps (anchor, 8-bit)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--prompt-kind", choices=("needle", "code"), default="needle",
                        help="needle: the TTkT runs' haystack prompts; code: cut from local Python sources")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    stages = [tuple(int(x) for x in s.split(":")) for s in args.stages]
    prov = provenance()
    from model_runner_harness import load_runner
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from transformers import AutoTokenizer
    from verify_experiment import local_prompts

    from sglang_lynx.integration.decode.chain_attention import CHAIN_ATTENTION_HOOKS
    from sglang_lynx.integration.decode.row_gemm import ROW_GEMM_HOOKS

    runner, wrapper = load_runner(args.model_dir, "bfloat16", max_total_tokens=8192)
    for path, hook, kind in (*ROW_GEMM_HOOKS, *CHAIN_ATTENTION_HOOKS):  # what a lynx decode server registers
        HookRegistry.register(path, hook, HookType(kind))
    HookRegistry.apply_hooks()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if args.prompt_kind == "needle":  # what the shaped-link TTkT runs send
        from sglang_lynx.launch.client import needle_prompt

        prompts = []
        for i in range(args.prompts):
            messages, _ = needle_prompt(args.lengths[i % len(args.lengths)], seed=i, depth=(i % 5) / 4)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer.encode(text))
    else:
        prompts = local_prompts(tokenizer, args.prompts, seed=args.seed, lengths=args.lengths)
    cases = []
    for prompt in prompts:
        for case in run_prompt(runner, wrapper, prompt, stages):
            cases.append(case)
            print(json.dumps(case), flush=True)
    rows = summarize(cases)
    print("| a (anchor drafts) | b (8-bit steps) | cases | released A | released B | B - A (95% CI) | B better / worse "
          "| 8-bit verify (steps) | released = exact greedy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['a']} | {r['b']} | {r['cases']} | {r['released_A_mean']:.2f} | {r['released_B_mean']:.2f} | "
              f"{r['B_minus_A_mean']:+.2f} ± {r['B_minus_A_ci95']:.2f} | {r['B_better']} / {r['B_worse']} | "
              f"{r['verify_8bit_steps_median']} | {r['all_equal_to_exact_greedy']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": prov, "settings": vars(args), "rows": rows,
                                              "cases": cases}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
