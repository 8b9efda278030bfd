"""Verification of one parked Lynx request inside SGLang's decode scheduler (one SGLang ``Req``).

Lifecycle (called by ``decode.scheduler`` between two batches, the request out of every batch and
out of every batch still in flight — with the overlap scheduler the hooks wait until the result of
its last batch was processed — so no forward of it is pending):

1. the request holds ``output_ids = [t0, d1 .. dn]``: ``t0`` exact (from prefill), ``d1..dn`` drafts
   computed on the anchor-only KV; KV is allocated for ``L + n`` positions (prompt, t0, d1..d(n-1));
2. :func:`verify_parked_request` — ``mode="verify"``: the prompt KV is upgraded in place
   (``progress.upgrade_kv()``), then the chain verify over ``[t0, d1 .. d(n-1)]`` at positions
   ``L .. L+n-1`` (``decode.verify``: a decode batch whose rows compute as decode steps); a greedy request
   with ``verify_first_pass > 0`` runs it in passes of 4, 8, 16 ... inputs and stops at the first pass that
   rejects a draft (:func:`greedy_verdict_in_passes`: same verdict and kept KV, fewer rows), a sampling
   request in one pass; ``mode="recompute"`` (residual failed or late, policy ``recompute``): the prompt
   KV is rebuilt on the decode server from token ids as a prefill computes it (``decode.verify.
   prefill_prompt_kv``: EXTEND passes of ``prefill_chunk`` tokens) instead of upgraded, then the same
   chain verify runs;
3. greedy accept (longest agreeing prefix + the target's correction; with a tie margin, acceptance
   stops before a near-tie position and the decode kernel decides it) — or, for a sampling request
   (temperature > 0), speculative sampling against the draft distributions recorded while drafting
   (``decode.sampling``; accept ``d`` with probability min(1, p(d)/q(d)), else resample from
   norm(max(0, p - q)); when no exact record exists every draft is rejected and the first position
   is drawn from ``p`` itself). With ``bonus=True`` the pass has one more row, input ``dn`` at
   position ``L+n`` in a slot allocated for it (``decode.bonus_slot``), and a fully accepted window
   also releases the token that row scores (the bonus) — rejected slots (the bonus slot among them) freed
   (``tree_cache.free_kv_row``, whole SGLang pages from the first page boundary at or after the new
   KV length; allocated == committed == the new KV length), ``output_ids`` set to
   the verified tokens, then the finish checks (EOS, stop strings, max tokens) replayed token by token
   exactly as plain decoding runs them, so a stop inside the draft window ends the request where
   plain decoding would have.

Device (issue 17): the drafts go to the logits' device (one host-to-device copy of ``n`` ids), the
draft laws and the request's generator are already there (``decode.sampling``, ``tracked.generator_for``),
and the verdict comes back to the host in one or two small reads (``decode/speculative.py``).

Invariant: after return, every token in ``output_ids`` is verified (greedy: equal to full-KV greedy
decoding; sampling: distributed exactly as full-KV sampling with the request's temperature / top-k /
top-p / min-p) and the KV of every position but the last output token is full-precision KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.decode.speculative import (
    ChainVerdict,
    auto_tie_margin,
    greedy_chain_accept,
    sampling_distribution,
    speculative_sample_chain,
)
from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
from sglang_lynx.integration.decode.bonus_slot import bonus_room, reserve_bonus_slot
from sglang_lynx.integration.decode.row_gemm import RowGemmPolicy
from sglang_lynx.integration.decode.verify import (
    chain_verify_logits,
    decode_batch_applies,
    decode_exact_measured,
    prefill_prompt_kv,
    slots_to_free_after_verify,
)


@dataclass(frozen=True)
class SamplingVerify:
    """What a sampling request's verification needs besides the target logits."""

    params: Any  # the request's sampling params (temperature, top_k, top_p, min_p)
    draft_probs: torch.Tensor | None  # [n, vocab]: the law each draft was sampled from; None: unknown
    generator: torch.Generator  # the request's own stream of uniforms (seeded from sampling_seed)


def sampled_chain_verdict(drafts: torch.Tensor, target_logits: torch.Tensor, sampling: SamplingVerify) -> ChainVerdict:
    """Speculative sampling of ``drafts`` against the target logits (module docstring, step 3)."""
    sp = sampling.params
    target = sampling_distribution(target_logits, float(sp.temperature), top_k=int(sp.top_k),
                                   top_p=float(sp.top_p), min_p=float(sp.min_p))
    if sampling.draft_probs is None:
        first = int(torch.multinomial(target[0], 1, generator=sampling.generator))
        return ChainVerdict(int(drafts.numel()), 0, first)
    return speculative_sample_chain(drafts, sampling.draft_probs.to(target.dtype), target, sampling.generator)


@dataclass(frozen=True)
class VerifyOutcome:
    num_drafts: int
    num_accepted: int
    new_output_len: int
    finished: bool
    upgrade_s: float = 0.0  # of the verify's time: the prompt KV's in-place upgrade (recompute: its prefill)
    rows: int = 0  # inputs the verify forward computed (fewer than the drafts when a pass stopped it early)
    bonus: bool = False  # a token after the last (accepted) draft was released (decode.bonus_slot)


def verify_parked_request(req: Any, model_runner: Any, tree_cache: Any, progress: Any, mode: str,
                          sampling: SamplingVerify | None = None, tie_margin: float = 0.0,
                          gemm: RowGemmPolicy | None = None, first_pass: int = 0,
                          attention: ChainAttentionKernel | None = None, bonus: bool = False,
                          prefill_chunk: int | None = None) -> VerifyOutcome:
    """Verify ``req``'s drafts (greedy, or speculative sampling when ``sampling`` is given) and leave
    it ready for re-admission (see module docstring). ``tie_margin < 0`` means automatic
    (``auto_tie_margin``: 0 where this verify runs as a decode batch or in fp32). ``gemm``: how its
    GEMMs treat the rows (``decode.row_gemm``; default ``split``, decode-exact); ``attention``: the chain
    attention kernel (``decode.attention_kernel``; None: one SDPA call per input, equal). ``first_pass > 0``: a
    greedy verify on the decode-batch path runs in passes (:func:`greedy_verdict_in_passes`). ``bonus``: one
    more row for the token after the last draft, when a slot for it can be had (``decode.bonus_slot``).
    ``prefill_chunk``: the recompute's EXTEND pass length (the server's ``--chunked-prefill-size``)."""
    if mode not in ("verify", "recompute"):
        raise ValueError(f"unknown verify mode {mode!r}")
    prompt = list(req.origin_input_ids)
    out = list(req.output_ids)
    if not out:
        raise ValueError(f"request {req.rid}: nothing to verify (no first token)")
    prompt_len, drafts = len(prompt), out[1:]
    n = len(drafts)
    allocated = int(req.kv.kv_allocated_len)
    if allocated != prompt_len + n or int(req.kv.kv_committed_len) != allocated:
        raise RuntimeError(
            f"request {req.rid}: KV bookkeeping allocated={allocated} committed={req.kv.kv_committed_len}, "
            f"expected {prompt_len + n} for a {prompt_len}-token prompt and {n} drafts")
    row = int(req.kv.req_pool_idx)
    started = time.monotonic()
    if mode == "verify":
        progress.upgrade_kv()
    else:
        prefill_prompt_kv(model_runner, row, prompt, prefill_chunk)
    upgrade_s = time.monotonic() - started
    prefix_len = prompt_len
    extra = int(bool(bonus and n and bonus_room(req, len(out))
                     and reserve_bonus_slot(req, model_runner, tree_cache)))
    allocated += extra
    inputs = (prompt + out)[prefix_len: prompt_len + n + extra]
    emitted: list[int] = []
    accepted = 0
    if tie_margin < 0:
        exact = (decode_batch_applies(prefix_len, len(inputs)) and (gemm is None or gemm.decode_exact)
                 and decode_exact_measured(model_runner))
        tie_margin = auto_tie_margin(tie_margin, getattr(model_runner, "dtype", torch.float32), exact)
    rows = 0
    if n and sampling is None and first_pass > 0 and decode_batch_applies(prefix_len, len(inputs)):
        verdict, rows = greedy_verdict_in_passes(model_runner, row, prefix_len, inputs, drafts, gemm, tie_margin,
                                                 first_pass, attention)  # fmt: skip
        emitted, accepted = verdict.emitted(drafts), verdict.num_accepted
    elif inputs:
        scored = n + extra  # the drafts' rows, then the bonus row
        logits = chain_verify_logits(model_runner, row, prefix_len, inputs, gemm, last_rows=scored,
                                     attention=attention)
        rows = len(inputs)
        if n:
            drafts_t = torch.tensor(drafts, dtype=torch.int64, device=logits.device)  # where the logits are
            verdict = (greedy_chain_accept(drafts_t, logits[-scored:], tie_margin) if sampling is None
                       else sampled_chain_verdict(drafts_t, logits[-scored:], sampling))
            emitted, accepted = verdict.emitted(drafts), verdict.num_accepted
    new_out = out[:1] + emitted
    start, end = slots_to_free_after_verify(prompt_len, len(new_out), allocated)
    # --page-size > 1: whole pages only; the partial page that holds the kept KV's end stays with the
    # request (SGLang's next decode step writes its next slot, as after any decode step)
    page_size = int(getattr(tree_cache, "page_size", 1) or 1)
    free_from = min(end, -(-start // page_size) * page_size)
    if end > free_from:
        tree_cache.free_kv_row(req.kv, [(free_from, end)])
    req.kv.kv_allocated_len = start
    req.kv.kv_committed_len = start
    finished = replay_finish(req, new_out)
    got_bonus = bool(extra) and accepted == n and len(emitted) > n
    rows += prompt_len if mode == "recompute" else 0  # the prompt's rows computed again
    return VerifyOutcome(n, accepted, len(req.output_ids), finished, upgrade_s, rows, got_bonus)


def greedy_verdict_in_passes(model_runner: Any, row: int, prefix_len: int, inputs: list[int], drafts: list[int],
                             gemm: RowGemmPolicy | None, tie_margin: float, first_pass: int,
                             attention: ChainAttentionKernel | None = None) -> tuple[ChainVerdict, int]:  # fmt: skip
    """The greedy verdict on ``drafts`` (input ``i`` of ``inputs`` scores draft ``i``), computed in passes of
    ``first_pass``, ``2 first_pass``, ``4 first_pass`` ... inputs; stops after the first pass whose verdict is
    not a full accept. ``inputs`` may hold one more input than there are drafts (the bonus row,
    ``decode.bonus_slot``): it goes with the last pass. Returns the verdict over all drafts and the number of
    inputs computed.

    Same verdict, same kept KV as one pass over every input: on the decode-batch path every row is
    computed on its own (1-row GEMMs, its own attention call over the row's first ``prefix + i + 1``
    slots: ``decode.verify``), so a row computes the same bits whether the rows before it were computed in
    this pass or an earlier one, which wrote their verified KV into the slots it reads. The rows after the
    stop are never computed: their slots still hold draft-time KV, and the caller frees them (every
    kept slot, the prefix, t0 and the accepted drafts, lies in a computed pass). What it saves: a verify's
    rows cost about the same each (on the CPU backend one 1-row GEMM chain and one attention call per
    row), and a draft rejected early makes every later row wasted work."""
    n = len(drafts)
    if len(inputs) not in (n, n + 1):
        raise ValueError(f"{len(inputs)} verify inputs for {n} drafts; expected {n} or {n + 1}")
    start, size = 0, first_pass  # > 0: the caller's condition, LynxConfig's bound
    bonus: int | None = None
    while start < n:
        end = min(n, start + size)
        stop = len(inputs) if end == n else end  # the last pass takes the bonus row too
        logits = chain_verify_logits(model_runner, row, prefix_len + start, inputs[start:stop], gemm,
                                     attention=attention)
        chunk = torch.tensor(drafts[start:end], dtype=torch.int64, device=logits.device)
        verdict = greedy_chain_accept(chunk, logits, tie_margin)
        if not verdict.fully_accepted:
            return ChainVerdict(n, start + verdict.num_accepted, verdict.next_token), stop
        bonus = verdict.next_token
        start, size = end, 2 * size
    return ChainVerdict(n, n, bonus), len(inputs)


def replay_finish(req: Any, verified: list[int]) -> bool:
    """Set ``output_ids`` to ``verified`` one token at a time, running SGLang's finish check after each
    token after the first (which was checked on admission); stop at the first finish."""
    req.finished_reason = None
    req.finished_len = None
    if list(req.output_ids[:1]) != list(verified[:1]):
        raise RuntimeError(f"request {req.rid}: the first output token changed during verification")
    del req.output_ids[1:]  # in place: SGLang keeps output_ids as array('q')
    for token in verified[1:]:
        req.output_ids.append(token)
        req.update_finish_state()
        if req.finished():
            return True
    return False
