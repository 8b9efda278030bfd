"""Every place where sglang-lynx hooks into SGLang, named once.

Each entry is a dotted path into the pinned SGLang (0.5.23) plus why we hook it. Hooks are only
ever registered through :func:`register`, which refuses names that are not in this table, and
``tests/foundation/test_hook_targets.py`` resolves every entry against the installed SGLang so an
upgrade that moves or renames one fails loudly instead of silently skipping a hook.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookTarget:
    path: str  # fully qualified dotted path in sglang
    why: str


_TARGETS: tuple[HookTarget, ...] = (
    # ---- command line and server arguments (plugin.py, cpu_host.py) ----
    HookTarget("sglang.srt.server_args.ServerArgs.add_cli_args", "add --lynx and --lynx-config"),
    HookTarget("sglang.srt.server_args.ServerArgs.from_cli_args",
               "validate --lynx-config, refuse unsupported flags (deployment_check), publish it to children"),
    HookTarget("sglang.srt.entrypoints.engine.Engine._launch_subprocesses",
               "launcher: withdraw the published Lynx config once the server's processes have inherited it"),
    HookTarget("sglang.srt.entrypoints.http_server.app",
               "launcher: a middleware answers /health and /health_generate 503 with the reason while a Lynx "
               "transport component is unhealthy (platform.health_gate; added, not a HookRegistry hook)"),
    HookTarget("sglang.srt.server_args.ServerArgs.resolve_once",
               "CPU hosts: default device/attention/graphs; refuse unsupported resolved values (deployment_check)"),
    HookTarget("sglang.srt.distributed.parallel_state.init_model_parallel_group",
               "CPU hosts: no PyNccl/custom/symm-mem communicators in TP groups (else --tp-size 2 raises on cpu)"),
    # ---- PD transport (cpu_host.py, transport_*.py) ----
    HookTarget("sglang.srt.disaggregation.utils.get_kv_class", "swap in the Lynx KV manager and receiver"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq",
               "prefill: read the decode's Lynx registration frame (arena, control endpoint, config)"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.TransferInfo.from_zmq",
               "prefill: read a request's Lynx metadata frame (where its streams go)"),
    HookTarget("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
               "decode: hand the KV pool tensors to the Lynx manager"),
    HookTarget("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
               "prefill: hand the KV pool tensors to the Lynx manager"),
    HookTarget("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
               ".get_internal_state", "/get_server_info: the Lynx transport's occupancy (staging, requests, pool)"),
    HookTarget("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
               "prefill: remember the prompt for encoded-page reuse (test hooks: read its prefill-side fault)"),
    HookTarget("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
               "prefill: freed KV slots (radix eviction, uncached KV) invalidate the encoded pages read from them"),
    HookTarget("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear",
               "prefill: a cleared KV pool (/flush_cache) clears the encoded-page cache"),
    HookTarget("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free",
               "prefill, --page-size > 1: freed KV slots invalidate the encoded pages read from them"),
    HookTarget("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_page_ids",
               "prefill, --page-size > 1: freed KV pages (free_kv_row) invalidate the encoded pages read from them"),
    HookTarget("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
               "prefill, --page-size > 1: a cleared KV pool (/flush_cache) clears the encoded-page cache"),
    HookTarget("sglang.srt.disaggregation.decode.DecodePreallocQueue._transfer_page_indices",
               "decode: the request's token count beside SGLang's page indices (the last page may be partial)"),
    # ---- decode server: progressive speculative decoding (decode_*.py) ----
    # (decode-hook section: entries are added here by the decode hooks)
    HookTarget("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
               "decode: before every batch track, park, verify and re-admit Lynx requests"),
    HookTarget("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
               "decode: never stream drafts; attach lynx_* meta_info fields"),
    HookTarget("sglang.srt.managers.schedule_batch.Req.update_finish_state",
               "decode: undo EOS / stop / max-tokens finish while drafting (decided after verify)"),
    HookTarget("sglang.srt.managers.schedule_batch.Req.init_next_round_input",
               "decode: a re-admitted (verified) Lynx request keeps its first admission's prefix bookkeeping"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.abort_request",
               "decode: abort parked Lynx requests through SGLang's waiting-queue path"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.is_fully_idle",
               "decode: not idle while Lynx requests are parked (their KV rows are owned, not leaked)"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle",
               "decode: no idle sleep while Lynx requests are parked waiting for their residual"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.run_batch",
               "decode, sampling drafts: name the batch's requests for the sampler hook; prefill, layer groups "
               "(stream_layer_group > 0): the chunks the forward computes (bootstrap_room, prefix_lens, "
               "extend_lens, req_to_token) are watched until it returns (transport.prefill_layer_hooks)"),
    HookTarget("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
               "prefill, layer groups: the write of a group's last layer hands the group's KV over"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.launch_batch_sample_if_needed",
               "decode, sampling drafts, overlap loop: a batch whose sampling is delayed (a grammar in it) "
               "samples here, after run_batch; name its requests for the sampler hook too"),
    HookTarget("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",
               "decode, chain verify: each row's GEMM rounds as a 1-row decode GEMM (decode_row_gemm)"),
    HookTarget("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
               "decode, chain verify on the CPU backend: the row's KV gathered once per layer, not once per "
               "input (decode.chain_attention)"),
    HookTarget("sglang.srt.layers.sampler.Sampler.forward",
               "decode, sampling drafts: record the law each draft token is sampled from"),
)

TARGETS: dict[str, HookTarget] = {t.path: t for t in _TARGETS}

# Non-hook attributes we read or set on SGLang objects; resolved by the same test.
ATTRIBUTES: tuple[HookTarget, ...] = (
    HookTarget(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices",
        "CPU hosts: False, else prefill uses pinned memory and torch.cuda.Event",
    ),
    HookTarget("sglang.srt.plugins.hook_registry.HookRegistry.register", "how hooks are registered"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache",
               "overridden by the Lynx manager (prefill: streams instead of raw KV blocks)"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.build_receiver_registration_message",
               "extended by the Lynx manager (decode: registration frame)"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.build_receiver_metadata_message",
               "extended by the Lynx manager (decode: per-request metadata frame)"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVReceiver._poll", "wrapped by the Lynx receiver"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure",
               "extended by the Lynx manager (decode: a prefill lost by the heartbeat fails its Lynx transfers)"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVManager.kv_status_msg_carries_reason",
               "set by the Lynx manager: prefill failure reasons reach the decode side (and the client)"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVManager.record_failure",
               "called by the Lynx prefill side: its refusal reason becomes the request's root cause"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVManager.conclude_failure",
               "overridden by the Lynx manager (prefill): a room the Lynx side refused un-blacklists its decode "
               "session (SGLang's transfer worker blacklists it on any failed send_kvcache)"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVManager.update_status",
               "extended by the Lynx manager (prefill): a room failed before its Lynx transfer started tells its "
               "decodes 'quiet' (their staging regions freed at once) and refuses its later chunks"),
    HookTarget("sglang.srt.disaggregation.base.conn.KVPoll.Failed",
               "read, not hooked: a room in the KV manager's request_status with another status is alive on the "
               "prefill (transport.prefill_peers.sglang_tracks: the stale sweep and the layered FIFO leave it), a "
               "Failed one reaches on_room_failed (kv_classes.update_status)"),
    HookTarget("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._unblacklist_session",
               "called by the Lynx manager's conclude_failure (with session_lock held, as SGLang requires)"),
    HookTarget("sglang.srt.disaggregation.common.conn.CommonKVReceiver.send_metadata",
               "wrapped by the Lynx receiver (staging reserved first)"),
    HookTarget("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.event_loop_overlap_disagg_decode",
               "decode, mode lynx: read, not hooked: the overlap loop keeps each launched batch in "
               "scheduler.result_queue until its result is processed one step later; the batch hook acts on a "
               "parked request only once no queued batch holds it (decode.scheduler._in_flight)"),
    HookTarget("sglang.srt.managers.scheduler.Scheduler.process_batch_result",
               "decode, mode lynx: read, not hooked: processes a queued batch's result (appends output_ids, "
               "finish check, streaming) — the point after which a parked request's output_ids and KV are final"),
    HookTarget("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row",
               "called by the verify (decode.commit): the rejected drafts' KV slots, whole pages from a page boundary"),
    HookTarget("sglang.srt.mem_cache.allocation.alloc_token_slots",
               "called by the verify (decode.bonus_slot, page size 1): the bonus row's slot, as a decode step "
               "allocates"),
    HookTarget("sglang.srt.mem_cache.allocation.alloc_paged_token_slots_decode",
               "called by the verify (decode.bonus_slot, --page-size > 1): the bonus row's slot, as a decode step "
               "allocates (the last page's next slot, or a new page)"),
)



@dataclass(frozen=True)
class VerifyBackend:
    """An attention backend the chain verify (``decode/verify.py``) is written for: its
    ``--attention-backend`` name, its class in the pinned SGLang, what of it has run."""

    name: str
    path: str  # the backend class (resolved by tests/foundation/test_hook_targets.py)
    state: str


#: The verify's contract with the attention backend (issue 17). The verify hands
#: ``model_runner.attn_backend.init_forward_metadata`` a ``ForwardBatch`` it builds itself: a DECODE batch
#: of ``n`` one-token virtual requests on one KV row (``forward_mode, batch_size, input_ids,
#: req_pool_indices, seq_lens, seq_lens_cpu, out_cache_loc, seq_lens_sum, positions``), or for the
#: recompute fallback an EXTEND batch of one request (plus ``extend_*`` lengths and their ``_cpu``
#: lists), and binds its KV-location plan as ``ForwardBatch.init_new`` does (``verify.bind_kv_plan``).
#: Every other field a backend's ``init_forward_metadata`` / ``forward_decode`` / ``forward_extend`` reads
#: is left at its dataclass default, which is what a non-speculative decoder-only batch has
#: (:data:`VERIFY_BATCH_DEFAULTS`); ``tests/foundation/test_verify_backends.py`` reads the backends'
#: source and fails when one starts reading a field outside these two lists. The verify runs eagerly
#: (``model.model(...)``), never through SGLang's CUDA-graph runner; see ``decode/verify.py`` for why
#: a parked or verifying request never replays a captured graph. Any other backend is refused at
#: start-up on a mode-``lynx`` decode server (``deployment_check``).
VERIFY_ATTENTION_BACKENDS: tuple[VerifyBackend, ...] = (
    VerifyBackend("torch_native", "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
                  "run: CPU, bit-identical to decode steps (tests/decode/test_verify_bf16_exact.py)"),
    VerifyBackend("flashinfer", "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend",
                  "written for (fields above), not run on a GPU; 16-bit verify uses the tie-margin guard"),
    VerifyBackend("triton", "sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
                  "written for (fields above), not run on a GPU; 16-bit verify uses the tie-margin guard"),
    VerifyBackend("fa3", "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend",
                  "written for (fields above), not run on a GPU; 16-bit verify uses the tie-margin guard"),
)

#: ForwardBatch fields the accepted backends read that the verify leaves at their default, and why
#: that default is what SGLang's own batch has for a plain (non-speculative, decoder-only) request.
VERIFY_BATCH_DEFAULTS: dict[str, str] = {
    "spec_info": "no SGLang speculative algorithm on a Lynx server (refused at start-up)",
    "spec_algorithm": "the same",
    "encoder_lens": "decoder-only models (no cross attention)",
    "encoder_out_cache_loc": "the same",
    "cross_attention_custom_mask": "the same",
    "attn_attend_prefix_cache": "chunked-prefix MLA only (MLA models are refused)",
    "mha_one_shot": "the same",
    "mha_return_lse": "the same",
    "prefix_chunk_idx": "the same",
    "prefix_chunk_cu_seq_lens": "the same",
    "prefix_chunk_max_seq_lens": "the same",
    "_attn_output": "an optional preallocated output buffer (None: the backend allocates)",
    "extend_num_tokens": "set on the EXTEND batch; a DECODE batch has none, as SGLang's",
    "extend_prefix_lens": "the same", "extend_prefix_lens_cpu": "the same",
    "extend_seq_lens": "the same", "extend_seq_lens_cpu": "the same", "extend_start_loc": "the same",
}


def resolve(path: str) -> Any:
    """Import and return the object at ``path`` (raises ImportError/AttributeError if gone)."""
    module_path, attr = path.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(module_path), attr)


def register(path: str, hook: Callable[..., Any], kind: str) -> None:
    """Register ``hook`` on ``path`` with SGLang's HookRegistry; ``kind`` is before/after/around/replace."""
    if path not in TARGETS:
        raise KeyError(f"{path} is not a declared hook target; add it to sglang_lynx.integration.hook_targets")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(path, hook, HookType(kind))
