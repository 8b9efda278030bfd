"""Measure extend (verify) vs decode greedy agreement, and draft acceptance on the lynx anchor.

Usage: OMP_NUM_THREADS=1 python benchmark/decode/extend_vs_decode.py --dtype float32|bfloat16
       [--prompts 20] [--steps 32] [--drafts 32] [--out benchmark/decode/results/extend_vs_decode.json]
One in-process SGLang ModelRunner (CPU, torch_native); prompts cut from local Python sources.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "decode"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.provenance import provenance  # noqa: E402
from model_runner_harness import load_runner  # noqa: E402
from verify_experiment import draft_then_verify, extend_vs_decode, local_prompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--drafts", type=int, default=32)
    parser.add_argument("--tie-margins", type=float, nargs="*", default=[0.5, 1.0],
                        help="also judge every verify with these greedy_chain_accept tie margins")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    prov = provenance()
    from transformers import AutoTokenizer

    runner, wrapper = load_runner(args.model_dir, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = local_prompts(tokenizer, args.prompts, seed=2026)
    equal = total = 0
    margins: list[float] = []
    max_diff = 0.0
    accepted, lossless, verify_s = [], 0, []
    guard_accepted: dict[float, list[int]] = {m: [] for m in args.tie_margins}
    guard_lossless: dict[float, int] = dict.fromkeys(args.tie_margins, 0)
    for prompt in prompts:
        agreement = extend_vs_decode(wrapper, runner, prompt, args.steps)
        equal += agreement.argmax_equal
        total += agreement.positions
        margins += agreement.disagreement_margins
        max_diff = max(max_diff, agreement.max_abs_logit_diff)
        t = time.perf_counter()
        outcome = draft_then_verify(wrapper, runner, prompt, args.drafts)
        verify_s.append(time.perf_counter() - t)
        accepted.append(outcome.num_accepted)
        lossless += outcome.emitted == outcome.reference[: len(outcome.emitted)]
        for margin in args.tie_margins:
            emitted, kept = outcome.judged(margin)
            guard_accepted[margin].append(kept)
            guard_lossless[margin] += emitted == outcome.reference[: len(emitted)]
    result = {
        "dtype": args.dtype,
        "prompts": len(prompts),
        "prompt_lengths": [len(p) for p in prompts],
        "extend_vs_decode_argmax_equal": equal,
        "extend_vs_decode_positions": total,
        "disagreement_top2_margins": margins,
        "max_abs_logit_diff": max_diff,
        "drafts_per_prompt": args.drafts,
        "accepted_per_prompt": accepted,
        "fully_accepted": sum(a == args.drafts for a in accepted),
        "released_equal_full_kv_greedy": lossless,
        "tie_margin_guard": {str(m): {"accepted_per_prompt": guard_accepted[m],
                                      "released_equal_full_kv_greedy": guard_lossless[m]} for m in args.tie_margins},
        "provenance": prov,
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
