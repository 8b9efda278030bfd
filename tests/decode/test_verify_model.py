"""Draft on the anchor-only KV, verify on the lynx-int8 KV, with the real model and SGLang's own
decode and extend kernels (in-process ModelRunner, fp32, torch_native attention).

Lossless at the verify level: what one verify pass releases must equal greedy decoding on the
full (anchor + residual) KV, for every prompt, whatever the acceptance. fp32 because extend and
decode kernels agree on greedy argmax there (bf16 is measured by benchmark/decode/extend_vs_decode.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

MODEL_DIR = Path(os.environ.get("SGLANG_LYNX_MODEL_DIR", Path.home() / ".cache/sglang-lynx/models/smollm2-135m"))


@pytest.fixture(scope="module")
def runner_and_tokenizer():  # type: ignore[no-untyped-def]
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"default model not prepared at {MODEL_DIR} (python -m sglang_lynx.models prepare smollm2-135m)")
    from model_runner_harness import load_runner
    from transformers import AutoTokenizer

    runner, wrapper = load_runner(str(MODEL_DIR), "float32")
    return runner, wrapper, AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_verify_over_exact_drafts_accepts_all(runner_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from verify_experiment import extend_vs_decode, local_prompts

    runner, wrapper, tokenizer = runner_and_tokenizer
    for prompt in local_prompts(tokenizer, 3, seed=7):
        agreement = extend_vs_decode(wrapper, runner, prompt, steps=12)
        assert agreement.argmax_equal == agreement.positions, agreement
        assert agreement.max_abs_logit_diff < 1e-2


def test_released_tokens_equal_greedy_on_full_kv(runner_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from verify_experiment import draft_then_verify, local_prompts

    runner, wrapper, tokenizer = runner_and_tokenizer
    accepted = []
    for prompt in local_prompts(tokenizer, 6, seed=11):
        outcome = draft_then_verify(wrapper, runner, prompt, num_drafts=12)
        n = len(outcome.emitted)
        assert outcome.emitted == outcome.reference[:n], outcome
        assert n == outcome.num_accepted + (1 if outcome.num_accepted < 12 else 0)
        accepted.append(outcome.num_accepted)
    print("accepted of 12 per prompt:", accepted)
