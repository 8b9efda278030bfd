"""Chain verification forward on SGLang's model runner (the one SGLang-facing verify primitive).

Lifecycle: the request's KV row ``req_to_token[row, :prefix_len + n]`` is allocated; the slots
``[prefix_len, prefix_len + n)`` hold draft-time KV (computed on the anchor-only prefix). When the
residual has landed and the prefix KV was upgraded, :func:`chain_verify_logits` runs ONE forward
pass over the ``n`` inputs ``t_0, d_1, .., d_{n-1}`` at positions ``prefix_len ..``; it overwrites
their KV and returns the logits of every position (fp32, ``[n, vocab]``), which
:func:`sglang_lynx.decode.speculative.greedy_chain_accept` turns into a verdict.

Exactness (issue 16): the pass must compute every position exactly as the decode step of that
position computes it, or the accepted drafts' KV differs from plain decoding by a rounding and the
greedy output leaves the ``lynx-int8`` path later on. So a chain verify after a prefix is a DECODE
forward batch of ``n`` virtual one-token requests that share the request's KV row: virtual request
``i`` feeds input ``i`` at position ``prefix_len + i`` with sequence length ``prefix_len + i + 1``
and writes its K/V into slot ``i`` of the row. Every layer writes the K/V of all ``n`` inputs before
its attention runs, so input ``i`` attends to the prefix and to inputs ``0..i`` computed in this very
pass (causal by the sequence lengths), through the backend's own decode attention and every
decode-mode branch of the model. The linear layers and the LM head run under
:func:`~sglang_lynx.integration.decode.row_gemm.row_invariant_gemms`, so each row rounds as a 1-row
decode GEMM rounds it. Measured (bf16, torch_native, this CPU): KV and logits bit-identical to ``n``
decode steps (``tests/decode/test_verify_bf16_exact.py``). With several requests in a decode batch,
plain decoding itself multiplies ``B`` rows at once and rounds by ``B``: equality is with one-request
decoding, which is what ``lynx-int8`` serving a request alone does.

On a GPU (issue 17; nothing here has run on one): the verify batch is handed to the backend's own
``init_forward_metadata`` (FlashInfer, Triton, FA3: the contract, i.e. which ``ForwardBatch`` fields
each reads and which the verify sets, is ``hook_targets.VERIFY_ATTENTION_BACKENDS``; others are refused
at start-up). Bit-identity with decode steps is measured on the CPU backend only: GPU decode kernels
choose their split-KV partitioning by batch size, so an ``n``-row verify batch may round differently
from 1-row decode steps; :func:`decode_exact_measured` says so, and the automatic tie margin of a
16-bit model then guards near-ties (``decode.speculative.auto_tie_margin``). CUDA graphs: the verify
calls ``model.model`` eagerly and never goes through SGLang's graph runner, so it replays no graph; a
parked request is out of every batch SGLang runs (the decode hooks take it out of the running batch
with SGLang's own filtering before the batch is built), and a verified request re-enters through
SGLang's prebuilt path, after which each step's ``ForwardBatch`` is built from the live batch and the
graph runner picks (or pads to) a graph for that batch size as for any request. No graph sees a parked
or verifying request, and none is captured with one. The sampler hook reads the logits the graph
returned but keeps only fresh tensors (the law it computes, a clone of the token), never a view into a
graph's output buffer.

The fallback "recompute" policy rebuilds the prompt's KV from token ids on the decode server as a prefill
computes it (:func:`prefill_prompt_kv`: EXTEND passes of the server's ``--chunked-prefill-size`` tokens), then
verifies the drafts after it as above (a decode batch): the same KV and logits as plain decoding on a
prefill's KV wherever the prefill server computed the prompt that way (alone, from no cached prefix, the same
chunk size; ``lynx-exact``'s fallback is lossless to stock PD there, ``tests/decode/test_lynx_exact_lossless.py``).

Invariants: runs under ``torch.no_grad``; writes only the ``n`` slots named by the row; never
allocates or frees (the caller owns slot bookkeeping, see :func:`slots_to_free_after_verify`).
Logits come from the model's final-norm hidden states through its own LM-head path
(``logits_processor._compute_lm_head``), like the decode step's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
from sglang_lynx.integration.decode.chain_attention import Chain, chain_attention
from sglang_lynx.integration.decode.row_gemm import RowGemmPolicy, row_invariant_gemms, rows_like_decode

DECODE_BATCH_MAX_INPUTS = 256  # a chain verify has <= max_draft_tokens (<= 256) inputs
_DEFAULT_POLICY = RowGemmPolicy("split")  # only for callers that pass none (tests, experiments); servers pass theirs


def decode_exact_measured(model_runner: Any) -> bool:
    """Whether this verify is known to be bit-identical to decode steps: on the CPU backend (measured);
    not on a GPU (module docstring), where a 16-bit model's automatic tie margin applies."""
    return torch.device(getattr(model_runner, "device", None) or "cpu").type == "cpu"


def decode_batch_applies(prefix_len: int, n: int) -> bool:
    """Whether a chain verify of ``n`` inputs after ``prefix_len`` runs as a decode batch (exact)."""
    return prefix_len > 0 and 0 < n <= DECODE_BATCH_MAX_INPUTS


def _row_slots(model_runner: Any, row: int, prefix_len: int, n: int) -> torch.Tensor:
    req_to_token = model_runner.req_to_token_pool.req_to_token
    total = prefix_len + n
    if total > req_to_token.shape[1]:
        raise ValueError(f"verify span {total} exceeds the row capacity {req_to_token.shape[1]}")
    slots = req_to_token[row, prefix_len:total].to(torch.int64)
    if n and int(slots.min()) <= 0:
        raise ValueError(f"row {row} has unallocated slots in [{prefix_len}, {total})")
    return slots


def _build_decode_batch(model_runner: Any, row: int, prefix_len: int, token_ids: list[int]) -> Any:
    """``n`` virtual one-token requests on one KV row (module docstring)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device = model_runner.device
    n = len(token_ids)
    slots = _row_slots(model_runner, row, prefix_len, n)
    seq_lens_cpu = torch.arange(prefix_len + 1, prefix_len + n + 1, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=n,
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        req_pool_indices=torch.full((n,), row, dtype=torch.int64, device=device),
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        out_cache_loc=slots,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        positions=torch.arange(prefix_len, prefix_len + n, dtype=torch.int64, device=device),
    )


def _build_extend_batch(model_runner: Any, row: int, prefix_len: int, token_ids: list[int]) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    device = model_runner.device
    n = len(token_ids)
    total = prefix_len + n
    slots = _row_slots(model_runner, row, prefix_len, n)
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


def bind_kv_plan(model_runner: Any, batch: Any) -> None:
    """Give ``batch`` its KV-location plan as ``ForwardBatch.init_new`` does for a forward that is its own
    iteration (``translator.own_plan(batch).bind(batch, translator)``): the GPU backends' metadata set-up
    (FlashInfer, Triton, FA3) reads ``forward_batch.kv_loc_plan`` to gather the rows' KV ids."""
    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is not None:
        translator.own_plan(batch).bind(batch, translator)


@torch.no_grad()
def prefill_prompt_kv(model_runner: Any, row: int, prompt: list[int], chunk: int | None) -> int:
    """Write the KV of ``prompt`` into the row's first ``len(prompt)`` slots as a prefill server computes it:
    EXTEND passes of ``chunk`` tokens (``None`` or <= 0: one pass), each attending to the passes before it
    through the row, SGLang's own (batched) GEMMs, no logits. Returns the number of passes."""
    if not prompt:
        raise ValueError("a prompt to prefill needs at least one token")
    step = chunk if chunk is not None and chunk > 0 else len(prompt)
    passes = 0
    for start in range(0, len(prompt), step):
        batch = _build_extend_batch(model_runner, row, start, prompt[start : start + step])
        with _forward(model_runner, batch, RowGemmPolicy("batched")):
            model_runner.model.model(batch.input_ids, batch.positions, batch)
        passes += 1
    return passes


@contextlib.contextmanager
def _forward(model_runner: Any, batch: Any, policy: RowGemmPolicy,
             chain: contextlib.AbstractContextManager[Any] | None = None) -> Iterator[None]:
    """Around a forward of the hand-built ``batch``: its KV plan bound and the backend's metadata set up (as
    for a forward that is its own iteration), SGLang's forward context, GEMMs under ``policy``, and ``chain``
    (the chain attention of a decode-batch verify) when given."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    bind_kv_plan(model_runner, batch)
    model_runner.attn_backend.init_forward_metadata(batch)
    ctx = ForwardContext(attn_backend=model_runner.attn_backend)
    with row_invariant_gemms(policy), chain or contextlib.nullcontext(), forward_context(ctx, forward_batch=batch):
        yield


@torch.no_grad()
def chain_verify_logits(model_runner: Any, row: int, prefix_len: int, token_ids: list[int],
                        policy: RowGemmPolicy | None = None, last_rows: int | None = None,
                        attention: ChainAttentionKernel | None = None) -> torch.Tensor:
    """One forward pass; returns fp32 logits ``[len(token_ids), vocab]`` (row i scores the token after
    input i) and writes the inputs' KV into the row's slots. ``policy``: how GEMMs keep rows
    decode-exact (default ``split``), on the decode-batch path only: an EXTEND pass (more inputs than a
    decode batch takes, or none before them: ``prefix_len`` 0) is not decode-exact whatever
    its GEMMs do, so it runs SGLang's batched GEMMs (a 1,400-token recompute with 1-row GEMMs held
    the scheduler for ~25 s). ``last_rows``: only the last that many logit rows are computed and
    returned (the LM head is the costliest GEMM of a long pass); None: every row. ``attention``: the chain
    attention kernel for the decode-batch path (None: one SDPA call per input; the same bits)."""
    if not token_ids:
        raise ValueError("chain verify needs at least one input token")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    model = model_runner.model
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise NotImplementedError(
            f"chain verify supports decoder models exposing .model and .lm_head; got {type(model).__name__}"
        )
    exact = decode_batch_applies(prefix_len, len(token_ids))
    batch = (_build_decode_batch if exact else _build_extend_batch)(model_runner, row, prefix_len, token_ids)
    policy = (policy or _DEFAULT_POLICY) if exact else RowGemmPolicy("batched")
    chain = chain_attention(Chain(row, prefix_len, len(token_ids)), attention) if exact else None
    with _forward(model_runner, batch, policy, chain):
        hidden = model.model(batch.input_ids, batch.positions, batch)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        head = model.lm_head
        if last_rows is not None:
            hidden = hidden[-max(1, int(last_rows)):]
        logits = rows_like_decode(lambda h: model.logits_processor._compute_lm_head(h, head, None), hidden,
                                  getattr(head, "weight", None))
        logits = _gather_vocab_shards(model.logits_processor, logits)
    return logits[:, : model.config.vocab_size].float()


def _gather_vocab_shards(processor: Any, logits: torch.Tensor) -> torch.Tensor:
    """At TP > 1 the LM head is vocab-parallel: each rank computed its own vocabulary shard. Gather the
    shards as the decode step's logits processor does (the same gatherer; a concatenation, so exact)."""
    if not getattr(processor, "do_tensor_parallel_all_gather", False):
        return logits
    if getattr(processor, "use_attn_tp_group", False):
        return processor._gather_attn_tp_logits(logits)  # type: ignore[no-any-return]
    return processor._logits_gatherer(logits)  # type: ignore[no-any-return]


def slots_to_free_after_verify(prefix_len: int, kept_output_len: int, allocated_len: int) -> tuple[int, int]:
    """Row range ``[start, end)`` whose KV slots are stale after verification (pure).

    After verification ``kept_output_len`` output ids remain; the last one is the next decode input,
    so KV is valid for ``prefix_len + kept_output_len - 1`` positions. Everything allocated beyond
    is freed (page size 1; with larger pages the caller frees from ``start`` rounded up to a page
    boundary: ``decode.commit``).
    """
    if kept_output_len < 1:
        raise ValueError("at least the first (exact) output token is always kept")
    start = prefix_len + kept_output_len - 1
    if start > allocated_len:
        raise ValueError(f"kept KV {start} exceeds the allocated length {allocated_len}")
    return start, allocated_len
