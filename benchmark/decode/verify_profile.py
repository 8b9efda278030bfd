"""Where one chain verify's time goes: cProfile of ``decode.verify.chain_verify_logits`` beside a decode step.

In process (bf16, the real model, SGLang's ``torch_native`` kernels, ``tests/decode`` harness): one
prompt of ``--tokens`` random token ids, ``--drafts`` greedy decode steps (their tokens are the chain),
then the verify of that chain timed for each attention path — the chain attention kernel (``integration
.decode.attention_kernel``, the servers' default), the chain attention's per-input SDPA calls
(``integration.decode.chain_attention``), the backend's own per-input gather — and each GEMM policy, and
profiled once (row-kernel GEMMs, the chain attention kernel) by function.

Usage: OMP_NUM_THREADS=1 python benchmark/decode/verify_profile.py [--tokens 1400] [--drafts 14]
       [--out benchmark/decode/results/verify_profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "decode"))

import torch  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402


def _timed(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--drafts", type=int, default=14)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    prov = provenance()
    from model_runner_harness import decode_steps, load_runner, prefill
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_lynx.integration.decode import chain_attention
    from sglang_lynx.integration.decode import verify as verify_module
    from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
    from sglang_lynx.integration.decode.row_gemm import ROW_GEMM_HOOKS, RowGemmPolicy
    from sglang_lynx.integration.decode.verify import chain_verify_logits

    runner, wrapper = load_runner(args.model_dir, "bfloat16", max_total_tokens=max(8192, args.tokens + 512))
    for path, hook, kind in (*ROW_GEMM_HOOKS, *chain_attention.CHAIN_ATTENTION_HOOKS):
        HookRegistry.register(path, hook, HookType(kind))
    HookRegistry.apply_hooks()
    prompt = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    t0, batch, _ = prefill(wrapper, prompt)
    started = time.perf_counter()
    drafts, _ = decode_steps(wrapper, batch, t0, args.drafts)
    decode_s = (time.perf_counter() - started) / args.drafts
    row, inputs = int(batch.req_pool_indices[0]), [t0, *drafts[:-1]]

    timings = {}
    kernel = ChainAttentionKernel()
    kernel_serves = kernel.prepare()
    for attention in ("chain kernel", "chain", "per-input gather"):
        if attention == "chain kernel" and not kernel_serves:
            continue
        if attention == "per-input gather":  # the backend's own loop: the verify enters no chain context
            verify_module.chain_attention = _NoChain()  # type: ignore[assignment]
        attend = kernel if attention == "chain kernel" else None
        for policy in ("rows", "split", "batched"):
            gemm = RowGemmPolicy(policy)  # one object per policy: the row kernel packs its weights once
            chain_verify_logits(runner, row, args.tokens, inputs, gemm, attention=attend)  # warm (pack, checks)
            seconds = _timed(lambda g=gemm, a=attend: chain_verify_logits(runner, row, args.tokens, inputs, g,
                                                                          attention=a))
            timings[f"{attention}, {policy} GEMMs"] = {"seconds": round(seconds, 4),
                                                       "decode_steps": round(seconds / decode_s, 2)}
    verify_module.chain_attention = chain_attention.chain_attention
    profile = cProfile.Profile()
    rows = RowGemmPolicy("rows")
    attend = kernel if kernel_serves else None
    chain_verify_logits(runner, row, args.tokens, inputs, rows, attention=attend)
    profile.runcall(chain_verify_logits, runner, row, args.tokens, inputs, rows, attention=attend)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.items()), reverse=True)[:12]
    result = {"provenance": prov, "settings": vars(args), "decode_step_s": round(decode_s, 4), "verify": timings,
              "attention_kernel": kernel_serves, "attention_calls": kernel.calls,
              "profile_rows_chain_tottime_s": [{"function": name, "seconds": round(t, 4)} for t, name in top]}
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


class _NoChain:
    """Stands in for ``chain_attention`` so that the verify runs the backend's per-input loop."""

    def __call__(self, chain: object, kernel: object = None) -> object:
        import contextlib

        return contextlib.nullcontext()


if __name__ == "__main__":
    main()
