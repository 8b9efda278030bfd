"""The Lynx transport wired into SGLang's Mooncake PD path: the hooks (targets in ``hook_targets.py``).

The KV manager and receiver subclasses, and what they do, are in ``transport.kv_classes``; here:

- an AROUND hook on ``get_kv_class`` (SGLang's transfer backends have no registry: it is an if/elif
  over an Enum) returns them in place of the Mooncake manager and receiver;
- AFTER hooks on ``KVArgsRegisterInfo.from_zmq`` / ``TransferInfo.from_zmq`` parse the Lynx frames on
  the prefill side (a decode peer with a different Lynx configuration is reported in the log at
  registration, and each of its requests fails with the same message), and on ``*._init_kv_manager``
  hand the KV pool tensors and the scheduler's limits to the manager, which sizes and registers its
  staging arena then (``transport.arena``; an arena size that cannot work refuses start-up);
- an AFTER hook on ``DecodePreallocQueue._transfer_page_indices`` leaves the request's token count on
  its receiver: SGLang's PD transfer speaks page indices (``--page-size``), whose last page may be
  partial; both sides turn them into the request's token slots (``transport.pages``);
- AFTER hooks on the KV allocators' ``free`` / ``free_page_ids`` / ``clear`` (page size 1 and paged)
  invalidate the prefill's encoded pages read from freed slots (``transport.page_cache``);
- an AFTER hook on the scheduler's ``get_internal_state`` adds a ``lynx`` block (staging occupancy,
  registered bytes, requests in progress, free KV pool tokens, and the transport's health:
  ``unhealthy_reason``, None while healthy, plus internal error counts) to ``/get_server_info``;
- test only (``SGLANG_LYNX_TEST_HOOKS=1``): an AFTER hook on ``PrefillBootstrapQueue.add`` reads a
  request's prefill-side fault (``transport.faults``).

Lifecycle and invariants: :func:`install_transport_hooks` runs once per SGLang process (the plugin),
hands the configuration to ``kv_classes`` and registers every hook before SGLang builds its KV
manager. The hooks keep no state of their own beyond the derived classes (one per SGLang base
class and kind); they read the configuration and the process's TP size from ``kv_classes``. The
observability hook never breaks the endpoint; a decode peer that does not match is logged, not
refused, at registration (its requests fail one by one).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_lynx.config import LynxConfig, LynxConfigError
from sglang_lynx.integration.hook_targets import register
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport import kv_classes
from sglang_lynx.integration.transport import page_cache as prefill_page_cache
from sglang_lynx.integration.transport.kv_classes import _make_manager, _make_receiver
from sglang_lynx.integration.transport.wire import (
    LynxWireError,
    config_fingerprint,
    parse_field,
    validate_registration,
)

logger = logging.getLogger("sglang_lynx.transport")

_CLASSES: dict[tuple[int, str], type] = {}


def _around_get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    cls = original(transfer_backend, class_type)
    if getattr(transfer_backend, "value", transfer_backend) != "mooncake" or cls is None:
        return cls
    kind = getattr(class_type, "value", str(class_type))
    makers = {"manager": _make_manager, "receiver": _make_receiver}
    if kind not in makers:
        return cls
    key = (id(cls), kind)
    if key not in _CLASSES:
        _CLASSES[key] = makers[kind](cls)
    return _CLASSES[key]


def _after_registration_from_zmq(result: Any, cls: Any, msg: list[bytes], *a: Any, **k: Any) -> Any:
    try:
        data = parse_field(msg)
        result.lynx = validate_registration(data) if data is not None else None
    except LynxWireError as exc:
        logger.error("lynx: rejected a decode registration: %s", exc)
        result.lynx = None
    config, local_tp = kv_classes.configured(), kv_classes.local_tp_size()
    if config is not None:
        mine = config_fingerprint(config)
        if result.lynx is None:
            logger.error("lynx: a decode server registered without Lynx (no --lynx?); its requests will fail: "
                         "start it with --lynx --lynx-config matching this prefill (%s)", mine)
        elif local_tp is not None and getattr(result, "dst_attn_tp_size", None) not in (None, local_tp):
            logger.error("lynx: tensor parallel sizes differ at bootstrap: decode %s has --tp-size %s, this prefill "
                         "has %s; its requests will fail: start both with the same --tp-size",
                         result.lynx["session"], result.dst_attn_tp_size, local_tp)
        elif result.lynx["fingerprint"] != mine:
            logger.error("lynx: Lynx configuration mismatch at bootstrap: decode %s has %s, this prefill has %s; "
                         "its requests will fail: start both with the same --lynx-config",
                         result.lynx["session"], result.lynx["fingerprint"], mine)
    return result


def _after_transfer_info_from_zmq(result: Any, cls: Any, msg: list[bytes], *a: Any, **k: Any) -> Any:
    try:
        data = parse_field(msg)
        keep = data is not None and (isinstance(data.get("target"), dict) or isinstance(data.get("refused"), str))
        result.lynx = data if keep else None
    except LynxWireError as exc:
        logger.error("lynx: rejected request metadata: %s", exc)
        result.lynx = None
    return result


def _after_init_kv_manager(manager: Any, queue: Any, *a: Any, **k: Any) -> Any:
    lynx = getattr(manager, "lynx", None)
    if lynx is not None:
        from sglang_lynx.integration.transport.arena import scheduler_limits

        pool = queue.token_to_kv_pool
        pool = getattr(pool, "full_kv_pool", pool)
        try:
            lynx.attach_pool(pool.k_buffer, pool.v_buffer, *scheduler_limits(queue, pool.k_buffer),
                             page_size=int(getattr(pool, "page_size", 1) or 1))
        except LynxConfigError as exc:  # an arena size that cannot work: the server must not start
            logger.error("sglang-lynx: cannot start: %s", exc)
            raise
    return manager


def _after_internal_state(result: Any, controller: Any, *a: Any, **k: Any) -> Any:
    """``/get_server_info``: the Lynx transport's occupancy beside SGLang's own state (leak checks). At TP > 1
    every rank runs this (SGLang broadcasts the request to the TP group) and the ranks' blocks are
    gathered over the TP CPU group: ``lynx.tp_ranks`` lists them (rank 0's is the top level)."""
    state: dict[str, Any] | None = None
    scheduler = getattr(controller, "scheduler", None)
    try:
        queue = (getattr(scheduler, "disagg_decode_prealloc_queue", None)
                 or getattr(scheduler, "disagg_prefill_bootstrap_queue", None))
        lynx = getattr(getattr(queue, "kv_manager", None), "lynx", None)
        if lynx is not None and scheduler is not None:
            state = dict(lynx.snapshot())
            state["kv_pool_free_tokens"] = int(scheduler.token_to_kv_pool_allocator.available_size())
    except Exception:  # observability must never break the endpoint
        logger.exception("lynx: could not report the transport state")
    group = getattr(scheduler, "tp_cpu_group", None)
    if int(getattr(scheduler, "tp_size", 1) or 1) > 1 and group is not None:
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, state, group=group)  # every rank, also one whose snapshot failed
        if state is not None:
            state["tp_ranks"] = gathered
    if state is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["lynx"] = state
    return result


def _after_prefill_queue_add(result: Any, queue: Any, req: Any, *a: Any, **k: Any) -> Any:
    """Remember the request's prompt for encoded-page reuse, by bootstrap room (and, test only, the
    prefill-side fault it asks for)."""
    lynx = getattr(getattr(queue, "kv_manager", None), "lynx", None)
    room = getattr(req, "bootstrap_room", None)
    if lynx is None or room is None:
        return result
    lynx.page_reuse.remember(int(room), req.origin_input_ids, getattr(queue, "scheduler", None))
    fault = transport_faults.fault_of(req) if transport_faults.test_hooks_enabled() else None
    if fault is not None:
        lynx.test_faults[int(room)] = fault
        logger.warning("lynx test fault: request %s (room %s) will get %s", req.rid, room, fault)
    return result


def _after_transfer_page_indices(result: Any, queue: Any, decode_req: Any, kv_indices: Any, *a: Any,
                                 **k: Any) -> Any:
    """Decode: SGLang turns the request's token slots into page indices right before ``send_metadata``;
    the token count (the last page may be partial) goes to the request's receiver (``transport.pages``)."""
    receiver = getattr(decode_req, "kv_receiver", None)
    if receiver is not None and hasattr(kv_indices, "__len__"):
        receiver.lynx_tokens = len(kv_indices)
    return result


def _after_kv_free(result: Any, allocator: Any, free_index: Any, *a: Any, **k: Any) -> Any:
    """KV slots handed back (radix eviction, a request's uncached KV): encoded pages read from them are
    invalidated (prefill)."""
    reuse = prefill_page_cache.reuse_of(allocator)
    if reuse is not None:
        reuse.on_slots_freed(free_index)
    return result


def _after_kv_free_pages(result: Any, allocator: Any, page_ids: Any, *a: Any, **k: Any) -> Any:
    """KV pages handed back by page id (``--page-size`` > 1: ``free_kv_row``): as ``_after_kv_free``."""
    reuse = prefill_page_cache.reuse_of(allocator)
    if reuse is not None:
        reuse.on_pages_freed(page_ids, int(allocator.page_size))
    return result


def _after_kv_clear(result: Any, allocator: Any, *a: Any, **k: Any) -> Any:
    reuse = prefill_page_cache.reuse_of(allocator)
    if reuse is not None:
        reuse.on_pool_cleared()
    return result


def install_transport_hooks(config: LynxConfig) -> None:
    """Register the transport hooks in this SGLang process."""
    kv_classes.configure(config)
    register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, "around")
    register("sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq",
             _after_registration_from_zmq, "after")
    register("sglang.srt.disaggregation.mooncake.conn.TransferInfo.from_zmq", _after_transfer_info_from_zmq, "after")
    register("sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager", _after_init_kv_manager, "after")
    register("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", _after_init_kv_manager,
             "after")
    register("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
             ".get_internal_state", _after_internal_state, "after")
    register("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add", _after_prefill_queue_add, "after")
    register("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free", _after_kv_free, "after")
    register("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear", _after_kv_clear, "after")
    paged = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
    register(f"{paged}.free", _after_kv_free, "after")
    register(f"{paged}.free_page_ids", _after_kv_free_pages, "after")
    register(f"{paged}.clear", _after_kv_clear, "after")
    register("sglang.srt.disaggregation.decode.DecodePreallocQueue._transfer_page_indices",
             _after_transfer_page_indices, "after")
    if config.stream_layer_group > 0:
        from sglang_lynx.integration.transport.prefill_layer_hooks import install_layer_hooks

        install_layer_hooks()
