"""The Lynx transport wired into SGLang's Mooncake PD path (hook targets in ``hook_targets.py``).

SGLang's transfer backends have no registry (``get_kv_class`` is an if/elif over an Enum), so an
AROUND hook on it returns small subclasses of the Mooncake manager and receiver:

- the **manager** builds a :class:`LynxPrefillSide` or :class:`LynxDecodeSide` for its role, appends
  the Lynx frames to the decode side's registration and metadata messages, and on the prefill side
  replaces ``send_kvcache`` (raw KV blocks) with the Lynx streams;
- the **receiver** asks for staging in ``send_metadata``; while the decode's receive arena has no room
  for it (FIFO, ``transport.decode_side``) it holds SGLang's metadata back and sends it from ``poll`` once
  the region is reserved (the prefill computes nothing before). In ``poll`` it holds SGLang's success
  (first token landed) back until the Lynx streams the mode needs have landed and been dequantized
  into the request's pool slots — or turns it into a failure with the reason;
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

Tensor parallelism: SGLang builds one manager per TP rank process, so each rank has its own Lynx side
(Mooncake engine, staging arena, control endpoint; ``TpRank`` from the manager's engine rank) and
moves its own KV heads; prefill rank i streams to decode rank i. A decode with another TP size
reaches ``send_kvcache_slice`` (SGLang reslices heads between widths): the request fails with the
reason (``prefill_side.tp_mismatch_reason``). The receiver remembers its DONE: SGLang keeps polling
until every TP rank agrees (``poll_and_all_reduce``, MIN), and the Lynx side reports DONE once.

Aux data (the first token, logprobs) travels exactly as SGLang sends it.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_lynx.config import LynxConfig, LynxConfigError
from sglang_lynx.integration.hook_targets import register
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport import page_cache as prefill_page_cache
from sglang_lynx.integration.transport.wire import (
    LynxWireError,
    TpRank,
    config_fingerprint,
    parse_field,
    validate_registration,
)

logger = logging.getLogger("sglang_lynx.transport")

_CONFIG: LynxConfig | None = None
_LOCAL_TP_SIZE: list[int] = []  # this process's attention TP size, once its manager exists (one per process)
_CLASSES: dict[tuple[int, str], type] = {}

def _host(server_args: Any, fallback: str) -> str:
    host = getattr(server_args, "host", None)
    return host if host and host not in ("0.0.0.0", "::") else fallback


def _page_size(manager: Any) -> int:
    """SGLang's KV page size of ``manager``'s pool (``--page-size``; 1 when not set)."""
    return int(getattr(getattr(manager, "kv_args", None), "page_size", 1) or 1)


def _torch_device(server_args: Any) -> Any:
    import torch

    return torch.device(getattr(server_args, "device", None) or "cpu")


def _make_manager(base: type) -> type:
    class LynxKVManager(base):  # type: ignore[misc, valid-type]
        # SGLang's Mooncake status messages carry no failure reason (mori/nixl's do): the decode side then
        # reports "it might be dead" for every prefill-side failure. The reason frame is optional on the
        # wire (parsers read it only when present), so a Lynx pair sends it: the client sees the cause.
        kv_status_msg_carries_reason = True

        def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, *rest: Any, **kw: Any) -> None:
            super().__init__(args, disaggregation_mode, server_args, *rest, **kw)
            assert _CONFIG is not None
            # prefill: rooms the Lynx side refused (room -> reason), until SGLang concludes them
            self.lynx_refused_rooms: dict[int, str] = {}
            host = _host(server_args, getattr(self, "local_ip", "127.0.0.1"))
            from sglang_lynx.integration.transport.protocol import mooncake_transport

            transport = mooncake_transport(server_args, getattr(args, "gpu_id", None))
            self.lynx: Any
            # one Lynx side per TP rank (each rank process has its own manager): its own Mooncake
            # engine, staging arena and control endpoint; it moves its own KV heads only
            rank = TpRank(int(getattr(self.kv_args, "engine_rank", 0) or 0) % max(1, self._lynx_tp_size()),
                          self._lynx_tp_size())
            _LOCAL_TP_SIZE[:] = [rank.size]
            if getattr(disaggregation_mode, "value", disaggregation_mode) == "prefill":
                from sglang_lynx.integration.transport.prefill_side import LynxPrefillSide

                self.lynx = LynxPrefillSide(_CONFIG, host, rank, transport)
            else:
                from sglang_lynx.integration.transport.decode_side import LynxDecodeSide

                self.lynx = LynxDecodeSide(_CONFIG, host, rank, transport)
            logger.info("sglang-lynx: %s transport up (mode %s, host %s, TP rank %d of %d, Mooncake %s)",
                        type(self.lynx).__name__, _CONFIG.mode, host, rank.rank, rank.size, transport.describe())
            from sglang_lynx.integration.transport.codec import prepare_fast_path

            prepare_fast_path(self.lynx.codec, _CONFIG, _torch_device(server_args))

        def _lynx_tp_size(self) -> int:
            return int(getattr(self, "attn_tp_size", 1) or 1)

        def send_kvcache(self, mooncake_session_id: str, prefill_kv_indices: Any, dst_kv_ptrs: Any,
                         dst_kv_indices: Any, *rest: Any, **kw: Any) -> int:
            return int(self.lynx.send_kvcache(self, mooncake_session_id, prefill_kv_indices, dst_kv_indices))

        def send_kvcache_slice(self, mooncake_session_id: str, prefill_kv_indices: Any, dst_kv_ptrs: Any,
                               dst_kv_indices: Any, dst_tp_rank: int, dst_attn_tp_size: int,
                               *rest: Any, **kw: Any) -> int:
            # SGLang calls this instead of send_kvcache when the decode's TP differs from this prefill's:
            # each side's Lynx streams hold its own rank's KV heads, so the request fails with the reason
            return int(self.lynx.refuse_tp_mismatch(self, mooncake_session_id, dst_kv_indices,
                                                    int(dst_attn_tp_size)))

        def update_status(self, bootstrap_room: int, status: Any) -> Any:
            result = super().update_status(bootstrap_room, status)
            on_failed = getattr(getattr(self, "lynx", None), "on_room_failed", None)  # prefill only
            if on_failed is not None and self.request_status.get(bootstrap_room) == _failed_status():
                on_failed(self, bootstrap_room)  # also when its decode's metadata comes after the failure
            return result

        def conclude_failure(self, *, bootstrap_room: int, failure_reason: str, **kw: Any) -> Any:
            # SGLang's transfer worker blacklists the decode session on any failed send_kvcache (a dead
            # peer: every later request to it then fails at once). A Lynx refusal of ONE request (its
            # peer's config, its metadata, no staging) says nothing about the session: forgive it here,
            # where the worker concludes that room, so the decode server's next requests go through.
            if self.lynx_refused_rooms.pop(bootstrap_room, None) is not None:
                self._lynx_forgive_sessions(bootstrap_room)
            return super().conclude_failure(bootstrap_room=bootstrap_room, failure_reason=failure_reason, **kw)

        def _lynx_forgive_sessions(self, room: int) -> None:
            lock = getattr(self, "session_lock", None)
            if lock is None:
                return
            with lock:
                for session_id, info in list(self.transfer_infos.get(room, {}).items()):
                    if getattr(info, "is_dummy", False) or session_id not in self.session_failures:
                        continue
                    left = self.session_failures[session_id] - 1  # the worker counted this refusal
                    if left <= 0:
                        self._unblacklist_session(session_id)
                    else:
                        self.session_failures[session_id] = left

        def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
            super()._handle_node_failure(failed_bootstrap_addr)  # SGLang's heartbeat lost a prefill
            on_lost = getattr(self.lynx, "on_prefill_lost", None)
            if on_lost is not None:
                on_lost(failed_bootstrap_addr)

        def build_receiver_registration_message(self) -> list[bytes]:
            return [*super().build_receiver_registration_message(), self.lynx.registration_field()]

        def build_receiver_metadata_message(self, **kw: Any) -> list[bytes]:
            message = list(super().build_receiver_metadata_message(**kw))
            field = None if kw.get("is_dummy") else self.lynx.metadata_field(kw["bootstrap_room"])
            return message + [field] if field is not None else message

    return LynxKVManager


def _failed_status() -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll.Failed


def _make_receiver(base: type) -> type:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_lynx.integration.transport.decode_side import Verdict

    class LynxKVReceiver(base):  # type: ignore[misc, valid-type]
        _lynx_deferred: tuple[Any, tuple, dict] | None = None  # metadata held back until staging is reserved
        # the Lynx side reported DONE (KV in the pool): SGLang polls again until every TP rank agrees
        # (poll_and_all_reduce, MIN), and a DONE is reported once, so later polls answer from here
        _lynx_done: bool = False
        lynx_tokens: int | None = None  # the request's KV tokens (set by _after_transfer_page_indices)

        def send_metadata(self, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
            try:
                ready = self.kv_mgr.lynx.expect(self.bootstrap_room, kv_indices, getattr(self, "bootstrap_addr", None),
                                                page_size=_page_size(self.kv_mgr),
                                                tokens=self.lynx_tokens)
            except Exception as exc:
                self._lynx_staging_failed(exc, (kv_indices, args, kwargs))
                return
            if ready:
                super().send_metadata(kv_indices, *args, **kwargs)
            else:  # no room in the receive arena yet: _poll sends it when the region is reserved
                self._lynx_deferred = (kv_indices, args, kwargs)

        def _lynx_staging_failed(self, exc: Exception, metadata: tuple[Any, tuple, dict]) -> None:
            """Fail the request here and still send SGLang's metadata, carrying the refusal: the prefill
            then fails its side at once (it would otherwise wait for metadata until SGLang's bootstrap
            timeout, and the router's answer with it)."""
            room = self.bootstrap_room
            logger.error("lynx: request %s: cannot reserve staging: %s", room, exc)
            self.kv_mgr.record_failure(room, f"Lynx staging: {exc}")
            self.kv_mgr.update_status(room, KVPoll.Failed)
            self.kv_mgr.lynx.refuse(room, f"the decode server could not stage it: {exc}")
            kv_indices, args, kwargs = metadata
            try:
                super().send_metadata(kv_indices, *args, **kwargs)
            except Exception as send_exc:  # the refusal is best effort; the decode side has failed already
                logger.error("lynx: request %s: could not tell the prefill: %s", room, send_exc)

        def _send_deferred_metadata(self) -> None:
            deferred, room = self._lynx_deferred, self.bootstrap_room
            assert deferred is not None
            try:
                ready = self.kv_mgr.lynx.reserve(room)
            except Exception as exc:
                self._lynx_deferred = None
                self.kv_mgr.lynx.abort(room, f"no staging: {exc}")
                self._lynx_staging_failed(exc, deferred)
                return
            if ready:
                self._lynx_deferred = None
                kv_indices, args, kwargs = deferred
                super().send_metadata(kv_indices, *args, **kwargs)

        def _poll(self) -> Any:
            if self._lynx_deferred is not None and getattr(self, "conclude_state", None) is None:
                self._send_deferred_metadata()
            status = super()._poll()
            if status == KVPoll.Failed:  # SGLang's own side failed: free our staging too
                self.kv_mgr.lynx.abort(self.bootstrap_room, "the SGLang transfer failed")
            if status != KVPoll.Success or self._lynx_done:
                return status
            self.kv_mgr.lynx.arm(self.bootstrap_room)
            # lynx mode admits on the anchor alone (the decode hooks draft on it and upgrade later);
            # every other mode waits for all of its streams.
            need_residual = not (_CONFIG is not None and _CONFIG.progressive)
            verdict, reason = self.kv_mgr.lynx.poll(self.bootstrap_room, need_residual=need_residual)
            if verdict is Verdict.PENDING:
                return KVPoll.Transferring
            if verdict is Verdict.FAILED:
                self.kv_mgr.record_failure(self.bootstrap_room, reason)
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            self._lynx_done = True
            return status

        def abort(self) -> None:
            self._lynx_deferred = None
            super().abort()
            self.kv_mgr.lynx.abort(self.bootstrap_room, "aborted by the decode scheduler")

    return LynxKVReceiver


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
    if _CONFIG is not None:
        mine = config_fingerprint(_CONFIG)
        if result.lynx is None:
            logger.error("lynx: a decode server registered without Lynx (no --lynx?); its requests will fail: "
                         "start it with --lynx --lynx-config matching this prefill (%s)", mine)
        elif _LOCAL_TP_SIZE and getattr(result, "dst_attn_tp_size", None) not in (None, _LOCAL_TP_SIZE[0]):
            logger.error("lynx: tensor parallel sizes differ at bootstrap: decode %s has --tp-size %s, this prefill "
                         "has %s; its requests will fail: start both with the same --tp-size",
                         result.lynx["session"], result.dst_attn_tp_size, _LOCAL_TP_SIZE[0])
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
    global _CONFIG
    _CONFIG = config
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
