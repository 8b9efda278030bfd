"""The prefill side's state and the parts every path shares (``prefill_side`` tells the lifecycle).

:class:`PrefillSideBase` owns the transport of one prefill server (TP rank): the Mooncake engine, the
send arena, the transfer scheduler and its callbacks, and the per-room bookkeeping that the buffered
path (``prefill_buffered``), the streamed path (``prefill_streaming``) and SGLang's entry points
(``prefill_side.LynxPrefillSide``) read and write under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport.arena import Arena, build_arena
from sglang_lynx.integration.transport.codec import page_range_encoder
from sglang_lynx.integration.transport.page_cache import PrefillPageReuse
from sglang_lynx.integration.transport.pages import pages_for
from sglang_lynx.integration.transport.prefill_peers import tp_mismatch_reason
from sglang_lynx.integration.transport.prefill_stream import StreamedRequest
from sglang_lynx.integration.transport.wire import TpRank, config_fingerprint
from sglang_lynx.transfer.control import MAX_PROGRESS_SPANS, ControlClient
from sglang_lynx.transfer.link import TokenBucketPacer
from sglang_lynx.transfer.peer_counts import PeerCounts
from sglang_lynx.transfer.progress import StreamEvent, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.staging import StagingAllocator
from sglang_lynx.transfer.streams import RemoteTarget, TransferMetadataError

logger = logging.getLogger("sglang_lynx.transport")

LINK_ENV = "SGLANG_LYNX_LINK_GBPS"


def pacer_from_env() -> TokenBucketPacer | None:
    """Benchmarks: emulate a link with the application pacer (None = unpaced). ``SGLANG_LYNX_LINK_GBPS``
    is a rate in Gb/s, or ``@/path`` to a file holding the rate (re-read while serving, so one
    deployment can be measured at several link rates)."""
    import os

    text = os.environ.get(LINK_ENV, "").strip()
    if not text:
        return None
    if text.startswith("@"):
        return TokenBucketPacer.from_rate_file(text[1:])
    try:
        return TokenBucketPacer(float(text))  # the pacer validates the range
    except ValueError:
        raise ValueError(f"{LINK_ENV}={text!r}: expected a rate in Gb/s (0 < rate < 10000) "
                         "or @/path/to/rate-file") from None


@dataclass
class Pending:
    """Chunks of one request copied out of the prefill pool, waiting for the last one."""

    total_pages: int  # SGLang pages the decode allocated (``len(dst_kv_indices)``)
    total_tokens: int  # tokens they hold (the last page may be partial: ``transport.pages``)
    target: RemoteTarget
    control: str
    active: float = field(default_factory=time.monotonic)  # when its last chunk came (the stale sweep's clock)
    k_parts: list[list[torch.Tensor]] = field(default_factory=list)
    v_parts: list[list[torch.Tensor]] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)  # prefill KV-pool slot of each token
    pages: int = 0


class PrefillSideBase:
    def __init__(self, config: LynxConfig, host: str, tp: TpRank | None = None, transport: Any = None) -> None:
        """``tp``: this server's TP rank; ``transport``: the Mooncake protocol and devices
        (``transport.protocol``; None: TCP)."""
        from sglang_lynx.transfer.mooncake_engine import TCP, MooncakeEngine

        self.config = config
        self.tp = tp or TpRank()
        self.codec = get_codec(config.codec_name, **config.codec_params())
        self.fingerprint = config_fingerprint(config)
        self.engine = MooncakeEngine.start(host, transport or TCP)
        self._arena: Arena | None = None  # built by attach_pool, once the KV pool exists
        self.control = ControlClient()
        self.pacer = pacer_from_env()
        self.page_reuse = PrefillPageReuse(config.prefill_page_cache_mb << 20, config.page_tokens)
        self.scheduler = TransferScheduler(self.engine, SchedulerParams.from_config(config), pacer=self.pacer,
                                           on_event=self._on_event)
        self.k_pool: list[torch.Tensor] = []
        self.v_pool: list[torch.Tensor] = []
        self.page_size = 1  # SGLang's KV page size (attach_pool)
        self._pending: dict[int, Pending] = {}
        self._streamed: dict[int, StreamedRequest] = {}  # rooms streamed while their prefill runs
        self._part_coder: Any = None  # the page-range encoder streaming uses (attach_pool; None: no streaming)
        self.requests_streamed = 0
        self.requests_layered = 0  # streamed by layer groups (prefill_layers)
        self._endpoints: dict[str, str] = {}  # request id -> control endpoint
        self.sent_to = PeerCounts()  # requests per decode peer (control endpoint), for xPyD checks
        self._lock = threading.Lock()
        # rooms between their last chunk and the scheduler taking them (neither pending nor submitted)
        self._submitting: set[int] = set()
        # rooms SGLang failed before their Lynx transfer started -> decode endpoints told "quiet"
        self._quieted: OrderedDict[int, set[str]] = OrderedDict()
        # rooms a forward computed whose send_kvcache has not taken their send region yet (monotonic time
        # seen): a layered request, which takes its region at its forward, must not go before them
        # (prefill_layers; their send_kvcache would wait for its region in the transfer worker, in front of
        # the layered request's own last chunk)
        self._unsent: OrderedDict[int, float] = OrderedDict()
        # test only (SGLANG_LYNX_TEST_HOOKS=1): room -> fault name, then request id -> (fault, target, lease)
        self.test_faults: dict[int, str] = {}
        self._faults: dict[str, tuple[str, RemoteTarget, Any]] = {}

    def attach_pool(self, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], pool_tokens: int,
                    max_request_tokens: int, page_size: int = 1) -> None:
        """The KV pool exists: size and register the send arena (LynxConfigError: start-up refused).
        ``page_size``: SGLang's (``--page-size``): SGLang's chunks then name pages, not token slots."""
        self.k_pool, self.v_pool, self.page_size = list(k_pool), list(v_pool), int(page_size)
        if self.config.stream_prefill and self.k_pool:
            self._part_coder = page_range_encoder(self.codec, self.config, self.k_pool[0].device)
        if self.config.stream_layer_group > 0 and self.k_pool and self.k_pool[0].device.type != "cpu":
            logger.warning("lynx: stream_layer_group=%d applies to CPU KV pools only; this %s pool streams each "
                           "request per chunk (set stream_layer_group: 0 to silence this)",
                           self.config.stream_layer_group, self.k_pool[0].device.type)  # fmt: skip
        if self._arena is None:
            self._arena = build_arena(self.config, "send", self.codec, self.engine, self.k_pool, pool_tokens,
                                      max_request_tokens)

    @property
    def arena(self) -> torch.Tensor:
        if self._arena is None:
            raise RuntimeError("Lynx prefill side has no KV pool attached (no send arena yet)")
        return self._arena.memory

    @property
    def send_alloc(self) -> StagingAllocator:
        if self._arena is None:
            raise RuntimeError("Lynx prefill side has no KV pool attached (no send arena yet)")
        return self._arena.allocator

    # ----- scheduler callbacks (sender thread) -----
    def _on_event(self, event: StreamEvent) -> None:
        with self._lock:
            endpoint = self._endpoints.get(event.request_id)
        if endpoint is None:
            return
        if event.state is TransferState.LANDED and event.descriptor is not None:
            desc, fault = event.descriptor, self._faults.get(event.request_id) if self._faults else None
            if fault is not None:
                desc = transport_faults.before_landed_notice(fault[0], self, desc, fault[1],
                                                             fault[2].regions[desc.kind].addr)
            self.control.send(endpoint, {"type": "landed", "desc": desc.to_dict()})
            if fault is not None:
                transport_faults.after_landed_notice(fault[0], desc)
        elif event.spans is not None:  # a part of a lynx-exact request is in place (the receiver reads ahead)
            spans = [list(span) for span in event.spans]
            for at in range(0, len(spans), MAX_PROGRESS_SPANS):
                self.control.send(endpoint, {"type": "progress", "request_id": event.request_id,
                                             "stream": event.kind.value, "spans": spans[at : at + MAX_PROGRESS_SPANS]})
        elif event.state in (TransferState.FAILED, TransferState.CANCELLED):
            reason = str(event.error) if event.error is not None else event.state.value
            self.control.send(endpoint, {"type": "failed", "request_id": event.request_id,
                                         "stream": event.kind.value, "reason": reason})

    def _on_quiet(self, request_id: str) -> None:
        with self._lock:
            endpoint = self._endpoints.pop(request_id, None)
            self._faults.pop(request_id, None)
        self.send_alloc.release(request_id)
        if endpoint is not None:
            self.sent_to.end(endpoint)
            self.control.send(endpoint, {"type": "quiet", "request_id": request_id})

    def _announce(self, room: int, control: str) -> None:
        """Tell ``room``'s decode that a Lynx prefill took it (``accepted``, see ``transfer.control``): the
        decode fails a request whose prefill reported success to SGLang without it (a prefill started
        without ``--lynx``) in seconds instead of at ``transfer_timeout_s``. Never under ``_lock``: a send
        to a dead decode waits out the control client's timeout."""
        self.control.send(control, {"type": "accepted", "request_id": str(room)})

    def _resolve_target(self, manager: Any, info: Any,
                        peer: dict | None) -> tuple[RemoteTarget, int, int, str] | str:
        """A request's (target, token count, decode pages, control endpoint) from its decode's metadata, or
        why it is refused."""
        if peer is None or getattr(info, "lynx", None) is None:
            return ("the decode server sent no Lynx registration or metadata: start it with --lynx and the same "
                    "--lynx-config as the prefill server")
        if isinstance(info.lynx.get("refused"), str):  # the decode failed it before sending a target
            return str(info.lynx["refused"])
        problem = self._check_peer(manager, peer, info)
        if problem:
            return problem
        try:  # peer metadata: parsed and bounds-checked before anything is copied or sent
            target = RemoteTarget.from_dict(info.lynx["target"])
        except (TransferMetadataError, KeyError, TypeError) as exc:
            return f"malformed Lynx target from the decode server: {exc}"
        total_pages = len(info.dst_kv_indices)
        tokens = info.lynx.get("tokens", total_pages if self.page_size == 1 else None)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or pages_for(tokens, self.page_size) != total_pages:
            return (f"the decode server's token count {tokens!r} does not fit its {total_pages} pages of "
                    f"{self.page_size} tokens")
        return target, tokens, total_pages, str(peer["control"])

    def _check_peer(self, manager: Any, peer: dict, info: Any) -> str:
        if peer.get("fingerprint") != self.fingerprint:
            return (f"Lynx configuration mismatch: decode has {peer.get('fingerprint')}, "
                    f"prefill has {self.fingerprint}; start both with the same --lynx-config")
        registration = getattr(manager, "decode_kv_args_table", {}).get(info.mooncake_session_id)
        decode_tp = getattr(registration, "dst_attn_tp_size", None)
        if decode_tp is not None and int(decode_tp) != self.tp.size:
            return tp_mismatch_reason(self.tp.size, int(decode_tp))
        if info.decode_prefix_len:
            return "the decode radix cache (--disaggregation-decode-enable-radix-cache) is not supported by Lynx yet"
        return ""
