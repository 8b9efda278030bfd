"""The bonus token's KV slot: one more verify row, so a fully accepted draft window releases one more token.

A parked request holds ``output_ids = [t0, d1 .. dn]`` and KV slots for the positions ``L .. L+n-1`` of the
inputs ``t0, d1 .. d(n-1)`` (``L`` prompt tokens): the last draft ``dn`` was never an input. The chain verify's
row ``i`` scores draft ``i + 1``; one more row, input ``dn`` at position ``L + n``, scores the token after the
last draft, which is what plain decoding's next step computes (it feeds ``dn``). When every draft is
accepted, that row's token is released too (greedy: its argmax, when not a near-tie; sampling: a draw from
its law, ``decode.speculative``), one decode step earlier, and the KV the row wrote for ``dn`` is the KV that
next step would have written (bit for bit on the decode-batch path: each row computes as a decode step).
When a draft is rejected the slot is freed with the rejected drafts' slots (``decode.commit``).

:func:`reserve_bonus_slot` allocates that slot as SGLang's decode step allocates one
(``mem_cache.allocation.alloc_for_decode_default``: ``alloc_token_slots``, or with ``--page-size > 1``
``alloc_paged_token_slots_decode``, which takes the next slot of the request's last page or a new page),
writes it into the request's ``req_to_token`` row at ``L + n`` and counts it in ``kv_allocated_len`` and
``kv_committed_len``. It reserves nothing (returns False; the verify runs its ``n`` rows as before) when:

- there are no drafts, or the request's ``max_new_tokens`` ends at the last draft (no token after it is
  ever released);
- the row has no column ``L + n``;
- the allocator has no free slot (with ``--page-size > 1``: no free page, even when the slot is the last
  page's next one) right now: the bonus never evicts cached prefixes; SGLang's own decode-memory check then
  sees the pool the next decode step would have left (that step allocates the bonus's input instead).

Tensor parallelism: every rank's allocator went through the same allocations and frees (the decisions that
drive them are agreed, ``decode.rank_agreement``), so every rank takes the same decision here and gets the
same slot.
"""

from __future__ import annotations

from typing import Any

import torch


def bonus_room(req: Any, num_outputs: int) -> bool:
    """Whether a token after ``num_outputs`` output ids can still be released (``max_new_tokens``)."""
    limit = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    return limit is None or num_outputs < int(limit)


def reserve_bonus_slot(req: Any, model_runner: Any, tree_cache: Any) -> bool:
    """Allocate the KV slot of position ``kv_allocated_len`` (the last draft's input) of ``req``'s row, as
    SGLang's decode step would (module docstring). Returns whether it did."""
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode, alloc_token_slots

    req_to_token_pool = model_runner.req_to_token_pool
    position = int(req.kv.kv_allocated_len)
    row = int(req.kv.req_pool_idx)
    req_to_token = req_to_token_pool.req_to_token
    if position < 1 or position >= req_to_token.shape[1]:
        return False
    allocator = tree_cache.token_to_kv_pool_allocator
    page_size = int(getattr(allocator, "page_size", 1) or 1)
    # one free slot (page size 1) or one free page: SGLang's allocation then never evicts (it evicts only on a
    # shortfall of that size; mid-page the slot is the last page's next one and no page is taken)
    if allocator.available_size() < page_size:
        return False
    if page_size == 1:
        loc = alloc_token_slots(tree_cache, 1)
    else:
        seq_lens_cpu = torch.tensor([position + 1], dtype=torch.int64)
        last_loc = req_to_token[row, position - 1: position].to(torch.int64)
        loc = alloc_paged_token_slots_decode(tree_cache, seq_lens_cpu.to(req_to_token.device), seq_lens_cpu,
                                             last_loc)
    req_to_token_pool.write((row, position), loc.reshape(-1)[0].to(torch.int32))
    req.kv.kv_allocated_len = position + 1
    req.kv.kv_committed_len = position + 1
    return True
