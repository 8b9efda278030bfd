"""The Lynx subclasses of SGLang's Mooncake KV manager and KV receiver (built by ``kv_manager``'s hooks).

SGLang's transfer backends have no registry (``get_kv_class`` is an if/elif over an Enum), so an
AROUND hook on it (``transport.kv_manager``) returns the classes :func:`_make_manager` and
:func:`_make_receiver` derive here from the Mooncake manager and receiver:

- the **manager** builds a :class:`LynxPrefillSide` or :class:`LynxDecodeSide` for its role, appends
  the Lynx frames to the decode side's registration and metadata messages, and on the prefill side
  replaces ``send_kvcache`` (raw KV blocks) with the Lynx streams;
- the **receiver** asks for staging in ``send_metadata``; while the decode's receive arena has no room
  for it (FIFO, ``transport.decode_side``) it holds SGLang's metadata back and sends it from ``poll`` once
  the region is reserved (the prefill computes nothing before). In ``poll`` it holds SGLang's success
  (first token landed) back until the Lynx streams the mode needs have landed and been dequantized
  into the request's pool slots — or turns it into a failure with the reason.

Tensor parallelism: SGLang builds one manager per TP rank process, so each rank has its own Lynx side
(Mooncake engine, staging arena, control endpoint; ``TpRank`` from the manager's engine rank) and
moves its own KV heads; prefill rank i streams to decode rank i. A decode with another TP size
reaches ``send_kvcache_slice`` (SGLang reslices heads between widths): the request fails with the
reason (``prefill_side.tp_mismatch_reason``). The receiver remembers its DONE: SGLang keeps polling
until every TP rank agrees (``poll_and_all_reduce``, MIN), and the Lynx side reports DONE once.

Aux data (the first token, logprobs) travels exactly as SGLang sends it.

Lifecycle and invariants: ``install_transport_hooks`` calls :func:`configure` once per SGLang process,
before SGLang builds its manager; a manager is only ever built with a configuration (asserted). The
classes are derived lazily, once per SGLang base class (cached by the ``get_kv_class`` hook). Each
process has one manager, whose ``__init__`` records the process's attention TP size
(:func:`local_tp_size`, read by the registration hook). SGLang itself is imported only inside the
factories, never at module import.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.wire import TpRank

logger = logging.getLogger("sglang_lynx.transport")

_CONFIG: LynxConfig | None = None  # set by configure (install_transport_hooks), once per process
_LOCAL_TP_SIZE: list[int] = []  # this process's attention TP size, once its manager exists (one per process)


def configure(config: LynxConfig) -> None:
    """The Lynx configuration the classes built from now on use (``install_transport_hooks``)."""
    global _CONFIG
    _CONFIG = config


def configured() -> LynxConfig | None:
    """The configuration set by :func:`configure`; None before."""
    return _CONFIG


def local_tp_size() -> int | None:
    """This process's attention TP size; None until its manager exists."""
    return _LOCAL_TP_SIZE[0] if _LOCAL_TP_SIZE else None


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
