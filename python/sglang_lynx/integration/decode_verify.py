"""Chain verification forward on SGLang's model runner (the one SGLang-facing verify primitive).

Lifecycle: the request's KV row ``req_to_token[row, :prefix_len + n]`` is allocated; the slots
``[prefix_len, prefix_len + n)`` hold draft-time KV (computed on the anchor-only prefix). When the
residual has landed and the prefix KV was upgraded, :func:`chain_verify_logits` runs ONE causal
EXTEND pass over the ``n`` inputs ``t_0, d_1, .., d_{n-1}`` at positions ``prefix_len ..``; it
overwrites their KV with full-precision KV and returns the logits of every position (fp32,
``[n, vocab]``), which :func:`sglang_lynx.decode.speculative.greedy_chain_accept` turns into a
verdict. The fallback "recompute" policy is the same call with ``prefix_len = 0`` over the whole
sequence (prompt + outputs): it recomputes the prefix KV from token ids on the decode server.

Attention: SGLang's CPU backend (``torch_native``) runs an EXTEND as full-length causal attention,
a query row for every prefix position too: O(S^2) per layer, ~3 s per verify at 5.6K tokens here
(measured, BENCHMARKS.md), i.e. a prefill's attention for every verify. For a chain verify (``n <=
DECODE_LIKE_MAX_INPUTS`` inputs after a prefix) :class:`DecodeLikeVerifyAttention` runs each input's
attention as the decode step for that position would (the backend's own ``forward_decode``, one
query, keys up to its position): O(n * S), and the attention of every position is computed exactly as
plain decoding computes it. Other backends (GPU ones extend efficiently) and the recompute fallback
keep the backend's extend.

Invariants: runs under ``torch.no_grad``; writes only the ``n`` slots named by the row; never
allocates or frees (the caller owns slot bookkeeping, see :func:`slots_to_free_after_verify`).
Logits come from the model's final-norm hidden states through its own LM-head path
(``logits_processor._compute_lm_head``), like the decode step's logits.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

DECODE_LIKE_MAX_INPUTS = 128  # a bound on the per-position loop; a chain verify has <= max_draft_tokens inputs
DECODE_LIKE_BACKENDS = ("TorchNativeAttnBackend",)  # backends whose forward_decode the loop may reuse


class DecodeLikeVerifyAttention:
    """An attention backend for one chain-verify EXTEND: input i's K/V is written and its attention
    computed by the wrapped backend's ``forward_decode`` at sequence length ``prefix_len + i + 1``
    (exactly a decode step's attention for that position); everything else is the wrapped backend's."""

    def __init__(self, inner: Any, row: int, prefix_len: int, slots: torch.Tensor) -> None:
        self.inner, self.prefix_len = inner, prefix_len
        device = slots.device
        self._steps = [SimpleNamespace(out_cache_loc=slots[i: i + 1], encoder_out_cache_loc=None, encoder_lens=None,
                                       req_pool_indices=torch.tensor([row], dtype=torch.int64, device=device),
                                       seq_lens=torch.tensor([prefix_len + i + 1], dtype=torch.int64, device=device))
                       for i in range(int(slots.numel()))]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        if kwargs or getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("decode-like verify attention: unexpected attention arguments")
        outs = [self.inner.forward_decode(q[i: i + 1], None if k is None else k[i: i + 1],
                                          None if v is None else v[i: i + 1], layer, step,
                                          save_kv_cache=save_kv_cache)
                for i, step in enumerate(self._steps)]
        return torch.cat(outs, dim=0)


def decode_like_applies(model_runner: Any, prefix_len: int, n: int) -> bool:
    """Whether a chain verify of ``n`` inputs after ``prefix_len`` runs the decode-like attention."""
    return (prefix_len > 0 and n <= DECODE_LIKE_MAX_INPUTS
            and type(getattr(model_runner, "attn_backend", None)).__name__ in DECODE_LIKE_BACKENDS)


def verify_attention(model_runner: Any, row: int, prefix_len: int, batch: Any) -> Any:
    """The backend for a chain verify: decode-like where it applies (see module docstring)."""
    inner = model_runner.attn_backend
    if decode_like_applies(model_runner, prefix_len, int(batch.out_cache_loc.numel())):
        return DecodeLikeVerifyAttention(inner, row, prefix_len, batch.out_cache_loc)
    return inner


def _build_extend_batch(model_runner: Any, row: int, prefix_len: int, token_ids: list[int]) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device = model_runner.device
    n = len(token_ids)
    total = prefix_len + n
    req_to_token = model_runner.req_to_token_pool.req_to_token
    if total > req_to_token.shape[1]:
        raise ValueError(f"verify span {total} exceeds the row capacity {req_to_token.shape[1]}")
    slots = req_to_token[row, prefix_len:total].to(torch.int64)
    if n and int(slots.min()) <= 0:
        raise ValueError(f"row {row} has unallocated slots in [{prefix_len}, {total})")
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor([row], dtype=torch.int64, device=device),
        seq_lens=torch.tensor([total], dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor([total], dtype=torch.int64),
        out_cache_loc=slots,
        seq_lens_sum=total,
        positions=torch.arange(prefix_len, total, dtype=torch.int64, device=device),
        extend_num_tokens=n,
        extend_prefix_lens=torch.tensor([prefix_len], dtype=torch.int32, device=device),
        extend_seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        extend_prefix_lens_cpu=[prefix_len],
        extend_seq_lens_cpu=[n],
        extend_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
    )


@torch.no_grad()
def chain_verify_logits(model_runner: Any, row: int, prefix_len: int, token_ids: list[int]) -> torch.Tensor:
    """One causal EXTEND pass; returns fp32 logits ``[len(token_ids), vocab]`` (row i scores the
    token after input i) and writes the inputs' KV into the row's slots."""
    if not token_ids:
        raise ValueError("chain verify needs at least one input token")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    batch = _build_extend_batch(model_runner, row, prefix_len, token_ids)
    model = model_runner.model
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise NotImplementedError(
            f"chain verify supports decoder models exposing .model and .lm_head; got {type(model).__name__}"
        )
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    model_runner.attn_backend.init_forward_metadata(batch)
    ctx = ForwardContext(attn_backend=verify_attention(model_runner, row, prefix_len, batch))
    with forward_context(ctx, forward_batch=batch):
        hidden = model.model(batch.input_ids, batch.positions, batch)
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    logits = model.logits_processor._compute_lm_head(hidden, model.lm_head, None)
    return logits[:, : model.config.vocab_size].float()


def slots_to_free_after_verify(prefix_len: int, kept_output_len: int, allocated_len: int) -> tuple[int, int]:
    """Row range ``[start, end)`` whose KV slots are stale after verification (pure).

    After verification ``kept_output_len`` output ids remain; the last one is the next decode input,
    so KV is valid for ``prefix_len + kept_output_len - 1`` positions. Everything allocated beyond
    is freed (page size 1; callers with larger pages align ``start`` up to a page boundary).
    """
    if kept_output_len < 1:
        raise ValueError("at least the first (exact) output token is always kept")
    start = prefix_len + kept_output_len - 1
    if start > allocated_len:
        raise ValueError(f"kept KV {start} exceeds the allocated length {allocated_len}")
    return start, allocated_len
