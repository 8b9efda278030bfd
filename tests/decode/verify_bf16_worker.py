"""Worker for ``test_verify_bf16_exact.py`` (own process: SGLang allows one ModelRunner per process).

For every prompt and draft count ``k``, on the real model in bf16 with SGLang's own kernels:

- reference (plain ``lynx-int8`` decoding): prefill, the prompt KV replaced by the lynx codec's full
  (anchor + residual) reconstruction, then ``k + 1`` greedy decode steps (the last one: the token after the
  ``k``-th, which a fully accepted verify releases as its bonus);
- lynx: prefill, the prompt KV replaced by the anchor-only reconstruction, ``k`` draft decode steps (and
  one more, whose drafted token is dropped: it allocates the slot of the bonus row's input, as the decode
  server's ``decode.bonus_slot`` does), the prompt KV upgraded to the full reconstruction, ONE chain verify
  (``decode.verify.chain_verify_logits``) over ``[t0, d1 .. d(k-1)]``, greedy acceptance;
- compared bit for bit: the released tokens against the reference's, the verify's logits against the
  decode steps' at every verified position, and the KV of every slot the request keeps (prompt, t0
  and the accepted drafts) against the reference's KV at the same positions, every layer, K and V.

The one-pass verify runs once per exact GEMM policy: ``rows`` (the servers' default: the row kernel,
``kernels/lynx_rows_gemm``, with the servers' default chain attention kernel, ``kernels/lynx_chain_sdpa``)
and ``split`` (one 1-row GEMM per row, one SDPA call per input). Before them, the verify the servers run
(``decode.commit.greedy_verdict_in_passes``: passes of 4, 8, 16 ... inputs, stopping at the first pass that
rejects a draft, with ``rows`` and the attention kernel, and the bonus row ``dk`` at the end of its last
pass), on the draft-time KV, is compared the same way (released tokens with the bonus, kept KV with the
bonus row's) and must reach the one pass's verdict.

Then the same verify again with the ``batched`` GEMM policy (SGLang's n-row GEMM), recorded only:
it shows what the exact policies guard against on this host. Prints one JSON object per case, then
a summary line ``{"summary": ...}``.

Usage: ``python verify_bf16_worker.py --model-dir DIR --prompts N --drafts 1 5 16 --seed S``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from model_runner_harness import decode_steps, load_runner, prefill  # noqa: E402
from verify_experiment import local_prompts, prefix_slots, reconstruct_prefix, write_prefix  # noqa: E402


def _row_kv(runner, row: int, length: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    pool = runner.token_to_kv_pool
    slots = runner.req_to_token_pool.req_to_token[row, :length].to(torch.int64)
    return [buf[slots].clone() for buf in (*pool.k_buffer, *pool.v_buffer)]


def run_case(runner, wrapper, prompt: list[int], k: int, policies) -> dict:  # type: ignore[no-untyped-def]
    from sglang_lynx.decode.speculative import greedy_chain_accept
    from sglang_lynx.integration.decode.commit import greedy_verdict_in_passes
    from sglang_lynx.integration.decode.verify import chain_verify_logits

    length = len(prompt)
    t0, batch, _ = prefill(wrapper, prompt)
    slots = prefix_slots(runner, batch, length)
    full = reconstruct_prefix(runner, slots, with_residual=True)
    anchor = reconstruct_prefix(runner, slots, with_residual=False)
    write_prefix(runner, slots, full)
    started = time.perf_counter()
    reference, ref_logits = decode_steps(wrapper, batch, t0, k + 1)
    decode_s = (time.perf_counter() - started) / (k + 1)
    ref_kv = _row_kv(runner, int(batch.req_pool_indices[0]), length + k + 1)

    t0_again, batch, _ = prefill(wrapper, prompt)
    assert t0_again == t0
    slots = prefix_slots(runner, batch, length)
    write_prefix(runner, slots, anchor)
    drafts = decode_steps(wrapper, batch, t0, k + 1)[0][:k]  # the step after the k-th: the bonus row's slot
    write_prefix(runner, slots, full)  # the residual lands: the prompt KV upgraded in place
    row = int(batch.req_pool_indices[0])
    inputs = [t0, *drafts[:-1]]
    out: dict = {"prompt_tokens": length, "drafts": k, "decode_step_s": round(decode_s, 5)}
    # first (the draft slots still hold draft-time KV): the verify in passes of 4, 8, 16 ... inputs that the
    # servers run (decode.commit.greedy_verdict_in_passes), with the first policy's GEMMs (rows)
    started = time.perf_counter()
    verdict, rows = greedy_verdict_in_passes(runner, row, length, [*inputs, drafts[-1]], drafts, policies[0][1],
                                             0.0, 4, policies[0][2])
    verify_s = time.perf_counter() - started
    emitted = verdict.emitted(drafts)
    bonus = len(emitted) > k
    kept = k + 1 if bonus else min(verdict.num_accepted + 1, k)  # inputs whose KV stays: t0, d1 .. (dk: bonus)
    kv = _row_kv(runner, row, length + kept)
    out["passes"] = {
        "accepted": verdict.num_accepted,
        "bonus": bonus,
        "rows": rows,
        "released_equal": emitted == reference[: len(emitted)],
        "kv_equal": all(torch.equal(a, b[: length + kept]) for a, b in zip(kv, ref_kv, strict=True)),
        "verify_s": round(verify_s, 4),
        "verify_in_decode_steps": round(verify_s / decode_s, 2),
    }
    for name, policy, attention in policies:
        started = time.perf_counter()
        logits = chain_verify_logits(runner, row, length, inputs, policy, attention=attention)
        verify_s = time.perf_counter() - started
        verdict = greedy_chain_accept(torch.tensor(drafts), logits, 0.0)
        emitted = verdict.emitted(drafts)
        kept = min(verdict.num_accepted + 1, k)  # inputs whose KV the request keeps: t0 .. d_accepted
        kv = _row_kv(runner, row, length + kept)
        kv_equal = all(torch.equal(a, b[: length + kept]) for a, b in zip(kv, ref_kv, strict=True))
        out[name] = {
            "accepted": verdict.num_accepted,
            "released_equal": emitted == reference[: len(emitted)],
            "logits_equal": bool(torch.equal(logits[:kept], ref_logits[:kept].float())),
            "kv_equal": kv_equal,
            "verify_s": round(verify_s, 4),
            "verify_in_decode_steps": round(verify_s / decode_s, 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 5, 16])
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="prompt lengths in turn (default: drawn)")
    parser.add_argument("--compare-batched", action="store_true")
    args = parser.parse_args()
    pool_tokens = max(8192, 2 * max(args.lengths or [0]) + 256)
    runner, wrapper = load_runner(args.model_dir, "bfloat16", max_total_tokens=pool_tokens)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from transformers import AutoTokenizer

    from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
    from sglang_lynx.integration.decode.chain_attention import CHAIN_ATTENTION_HOOKS
    from sglang_lynx.integration.decode.row_gemm import ROW_GEMM_HOOKS, RowGemmPolicy

    for path, hook, kind in (*ROW_GEMM_HOOKS, *CHAIN_ATTENTION_HOOKS):  # what a lynx decode server registers
        HookRegistry.register(path, hook, HookType(kind))
    HookRegistry.apply_hooks()
    attention = ChainAttentionKernel()  # as a decode server prepares it: the self-check first
    attention.prepare()
    policies = [("rows", RowGemmPolicy("rows"), attention), ("split", RowGemmPolicy("split"), None)]
    if args.compare_batched:
        policies.append(("batched", RowGemmPolicy("batched"), None))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = local_prompts(tokenizer, args.prompts, seed=args.seed, max_len=args.max_len, lengths=args.lengths)
    cases = []
    for i, prompt in enumerate(prompts):
        case = run_case(runner, wrapper, prompt, args.drafts[i % len(args.drafts)], policies)
        cases.append(case)
        print(json.dumps(case), flush=True)
    summary = {name: {"cases": len(cases),
                      "kv_equal": sum(c[name]["kv_equal"] for c in cases),
                      "logits_equal": sum(c[name]["logits_equal"] for c in cases),
                      "released_equal": sum(c[name]["released_equal"] for c in cases),
                      "drafts": sum(c["drafts"] for c in cases),
                      "accepted": sum(c[name]["accepted"] for c in cases)}
               for name, _, _ in policies}
    summary["passes"] = {"cases": len(cases), "kv_equal": sum(c["passes"]["kv_equal"] for c in cases),
                         "released_equal": sum(c["passes"]["released_equal"] for c in cases),
                         "same_verdict": sum(c["passes"]["accepted"] == c["rows"]["accepted"] for c in cases),
                         "bonus": sum(c["passes"]["bonus"] for c in cases),
                         "rows": sum(c["passes"]["rows"] for c in cases), "drafts": sum(c["drafts"] for c in cases)}
    from sglang_lynx.kernels import lynx_rows_gemm

    print(json.dumps({"summary": summary, "calls": {name: policy.calls for name, policy, _ in policies},
                      "row_kernel": lynx_rows_gemm.available(), "attention_kernel": attention.ready,
                      "attention_calls": attention.calls}), flush=True)


if __name__ == "__main__":
    main()
