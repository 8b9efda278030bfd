"""Draft-on-anchor / verify-on-full experiments on the in-process runner (shared by tests and the
benchmark script). The anchor/full KV come from the real ``lynx`` codec (sglang_lynx.codec):
prefix KV -> encode per layer -> decode anchor-only (draft KV) or anchor+residual (lynx-int8 KV).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from model_runner_harness import decode_steps, prefill

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.decode.speculative import greedy_chain_accept
from sglang_lynx.integration.decode.verify import chain_verify_logits


def local_prompts(tokenizer: Any, count: int, seed: int = 0, max_len: int = 600,
                  lengths: list[int] | None = None) -> list[list[int]]:
    """Deterministic prompts cut from local Python sources: of varied lengths (16..``max_len`` tokens), or
    of the given ``lengths`` in turn."""
    text = Path(os.__file__).read_text() + Path(torch.__file__).read_text()
    ids = tokenizer.encode(text)
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        drawn = int(torch.randint(16, max_len, (1,), generator=gen))
        length = min(lengths[i % len(lengths)], len(ids) - 1) if lengths else drawn
        start = int(torch.randint(0, len(ids) - length, (1,), generator=gen))
        prompts.append(ids[start : start + length])
    return prompts


def prefix_slots(runner: Any, batch: Any, prefix_len: int) -> torch.Tensor:
    row = int(batch.req_pool_indices[0])
    return runner.req_to_token_pool.req_to_token[row, :prefix_len].to(torch.int64)


def reconstruct_prefix(runner: Any, slots: torch.Tensor, with_residual: bool) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (k, v) as the lynx codec reconstructs them from the pool's current prefix KV."""
    codec = get_codec("lynx")
    pool = runner.token_to_kv_pool
    out = []
    for layer in range(len(pool.k_buffer)):
        pair = []
        for kind, buf in (("k", pool.k_buffer[layer]), ("v", pool.v_buffer[layer])):
            enc = codec.encode(buf[slots].float(), kind, layer=layer)
            pair.append(codec.decode(enc, with_residual=with_residual, dtype=buf.dtype))
        out.append(tuple(pair))
    return out


def write_prefix(runner: Any, slots: torch.Tensor, kv: list[tuple[torch.Tensor, ...]]) -> None:
    pool = runner.token_to_kv_pool
    for layer, (k, v) in enumerate(kv):
        pool.k_buffer[layer][slots] = k
        pool.v_buffer[layer][slots] = v


@dataclass
class DraftVerifyOutcome:
    reference: list[int]  # greedy decode on the lynx-int8 (anchor + residual) prefix KV
    drafts: list[int]  # greedy decode on the anchor-only prefix KV
    emitted: list[int]  # what Lynx releases after one verify pass
    num_accepted: int
    verify_logits: torch.Tensor  # [n, vocab] of the verify pass (re-judge with another tie margin)

    def judged(self, tie_margin: float) -> tuple[list[int], int]:
        """(released tokens, accepted drafts) under ``greedy_chain_accept(..., tie_margin)``."""
        verdict = greedy_chain_accept(torch.tensor(self.drafts), self.verify_logits, tie_margin)
        return verdict.emitted(self.drafts), verdict.num_accepted


def draft_then_verify(wrapper: Any, runner: Any, prompt: list[int], num_drafts: int) -> DraftVerifyOutcome:
    t0, batch, _ = prefill(wrapper, prompt)
    slots = prefix_slots(runner, batch, len(prompt))
    full = reconstruct_prefix(runner, slots, with_residual=True)
    anchor = reconstruct_prefix(runner, slots, with_residual=False)
    write_prefix(runner, slots, full)
    reference, _ = decode_steps(wrapper, batch, t0, num_drafts + 1)

    t0_again, batch, _ = prefill(wrapper, prompt)
    assert t0_again == t0
    slots = prefix_slots(runner, batch, len(prompt))
    write_prefix(runner, slots, anchor)
    drafts, _ = decode_steps(wrapper, batch, t0, num_drafts)
    write_prefix(runner, slots, full)  # the residual lands: upgrade the prefix KV
    row = int(batch.req_pool_indices[0])
    logits = chain_verify_logits(runner, row, len(prompt), [t0, *drafts[:-1]])
    verdict = greedy_chain_accept(torch.tensor(drafts), logits)
    return DraftVerifyOutcome(reference, drafts, verdict.emitted(drafts), verdict.num_accepted, logits)


@dataclass
class ExtendDecodeAgreement:
    positions: int
    argmax_equal: int
    disagreement_margins: list[float]  # decode-path top-2 logit margin where the argmax differed
    max_abs_logit_diff: float


def extend_vs_decode(wrapper: Any, runner: Any, prompt: list[int], steps: int) -> ExtendDecodeAgreement:
    t0, batch, _ = prefill(wrapper, prompt)
    tokens, decode_logits = decode_steps(wrapper, batch, t0, steps)
    row = int(batch.req_pool_indices[0])
    extend_logits = chain_verify_logits(runner, row, len(prompt), [t0, *tokens[:-1]])
    equal = extend_logits.argmax(-1) == decode_logits.argmax(-1)
    top2 = decode_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[~equal].tolist()
    diff = float((extend_logits - decode_logits).abs().max())
    return ExtendDecodeAgreement(steps, int(equal.sum()), margins, diff)
