"""Prefill side of the Lynx transport, called from the Lynx KV manager inside SGLang's transfer worker.

Lifecycle of one request (bootstrap room):

1. SGLang's transfer worker calls ``send_kvcache`` once per prefill chunk, in order, with the chunk's
   SGLang page indices (token slots at ``--page-size 1``). Each call copies the K and V of the pages'
   token slots out of the prefill KV pool (the pool pages are freed once SGLang reports success, so
   nothing may be read from them later) and returns 0 at once.
2. When the copied chunks cover every page the decode side allocated, the request's KV is cut to its
   token count (from the decode's Lynx metadata: the last page may be partial; ``transport.pages``),
   and the request takes a region of
   the registered send arena (``LynxConfig.send_arena_mb``, sized at ``attach_pool``:
   ``transport.arena``). If the arena is full it waits its turn (FIFO, at most ``transfer_timeout_s``)
   in SGLang's transfer worker, which holds back the next chunks (back-pressure on the prefill: its
   pool pages are freed only after success); a request larger than the whole arena fails at once,
   naming the field. It is then handed to the
   :class:`~sglang_lynx.transfer.scheduler.TransferScheduler`: its encode thread runs the codec into its
   region while the sender thread keeps the wire busy with earlier
   requests (encode of i+1 overlaps sending i); anchors go before any residual, across requests.
   Full pages a radix-cached prefix shares with an earlier request (same tokens, same KV slots) are
   copied from the encoded-page cache instead of encoded (``transport.page_cache``).
3. Scheduler events become control notices to the decode side (``landed`` with the stream's crc32,
   ``failed`` with the reason, ``quiet`` when no write can still land); the send region is freed on
   ``quiet``.

A request of several chunks is instead **streamed** while its prefill runs, where the codec has a
page-range encoder on the KV's device (``LynxConfig.stream_prefill``, on by default; ``prefill_stream``):
its region is taken at its first chunk and each chunk's complete codec pages are encoded and queued at
once, the same bytes as the whole-request encode, sent under the same priority rules.

A decode peer that registered no Lynx arena, or a different Lynx configuration, makes the chunk fail
(return -1) with the reason logged and recorded: SGLang then fails the request on both sides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.codec.wire_residual import residual_to_wire
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport.arena import Arena, KVShape, build_arena, stream_sizes
from sglang_lynx.integration.transport.codec import encode_exact_stream, encode_request_streams, page_range_encoder
from sglang_lynx.integration.transport.page_cache import PrefillPageReuse
from sglang_lynx.integration.transport.pages import pages_for, token_slots
from sglang_lynx.integration.transport.prefill_stream import StreamedRequest, StreamState
from sglang_lynx.integration.transport.wire import TpRank, config_fingerprint, dump_kv
from sglang_lynx.transfer.control import ControlClient
from sglang_lynx.transfer.link import TokenBucketPacer
from sglang_lynx.transfer.peer_counts import PeerCounts
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, StreamEvent, TransferState
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.staging import StagingAllocator, StagingTooLargeError
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, TransferMetadataError

logger = logging.getLogger("sglang_lynx.transport")

LINK_ENV = "SGLANG_LYNX_LINK_GBPS"
MAX_REFUSED_ROOMS = 4096
MAX_QUIETED_ROOMS = 4096


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


def _same_buffer(chunk: Any, whole: Any) -> bool:
    """Whether ``chunk`` is a view into ``whole`` (numpy arrays; anything else: no)."""
    return isinstance(chunk, np.ndarray) and isinstance(whole, np.ndarray) and bool(np.may_share_memory(chunk, whole))


def find_chunk_owner(manager: Any, session_id: str, dst_kv_indices: Any) -> tuple[int, Any, dict | None] | None:
    """The room (with its transfer info and the decode's Lynx registration) a chunk belongs to.

    SGLang's transfer worker passes a slice of the room's own
    ``dst_kv_indices`` array, so the room is the one whose array the chunk views. Matching by value
    alone is wrong when the decode reused slots: a room the prefill still holds (aborted, failed, not
    yet cleaned up) may list the same first slot, and taking it cut the live request's KV short
    ("sent 986 pages, decode allocated 675" in the soak). Without a shared buffer (a copy), the
    latest registered room holding the first slot wins.
    """
    if len(dst_kv_indices) == 0:
        return None
    first = int(dst_kv_indices[0])
    owner = None
    for room, infos in list(manager.transfer_infos.items()):
        info = infos.get(session_id)
        if info is None or info.is_dummy:
            continue
        if _same_buffer(dst_kv_indices, info.dst_kv_indices):
            owner = (room, info)
            break
        if first in info.dst_kv_indices:
            owner = (room, info)  # dict order: a later registration replaces an earlier one
    if owner is None:
        return None
    registration = manager.decode_kv_args_table.get(session_id)
    return owner[0], owner[1], getattr(registration, "lynx", None)


def _decode_endpoints(manager: Any, room: int) -> list[str]:
    """The control endpoints of the Lynx decodes that were given a target for ``room``."""
    endpoints = []
    for session_id, info in list(getattr(manager, "transfer_infos", {}).get(room, {}).items()):
        lynx = getattr(info, "lynx", None)
        if getattr(info, "is_dummy", False) or not isinstance(lynx, dict) or "target" not in lynx:
            continue
        registration = getattr(manager, "decode_kv_args_table", {}).get(session_id)
        control = (getattr(registration, "lynx", None) or {}).get("control")
        if isinstance(control, str):
            endpoints.append(control)
    return endpoints


def tp_mismatch_reason(prefill_tp: int, decode_tp: int) -> str:
    return (f"tensor parallel sizes differ: prefill --tp-size {prefill_tp}, decode --tp-size {decode_tp}; Lynx "
            "streams each rank's own KV heads to the decode rank of the same index, so both servers need the "
            "same --tp-size")


@dataclass
class _Pending:
    """Chunks of one request copied out of the prefill pool, waiting for the last one."""

    total_pages: int  # SGLang pages the decode allocated (``len(dst_kv_indices)``)
    total_tokens: int  # tokens they hold (the last page may be partial: ``transport.pages``)
    target: RemoteTarget
    control: str
    started: float = field(default_factory=time.monotonic)
    k_parts: list[list[torch.Tensor]] = field(default_factory=list)
    v_parts: list[list[torch.Tensor]] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)  # prefill KV-pool slot of each token
    pages: int = 0


class LynxPrefillSide:
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
        self._pending: dict[int, _Pending] = {}
        self._streamed: dict[int, StreamedRequest] = {}  # rooms streamed while their prefill runs
        self._part_coder: Any = None  # the page-range encoder streaming uses (attach_pool; None: no streaming)
        self.requests_streamed = 0
        self._endpoints: dict[str, str] = {}  # request id -> control endpoint
        self.sent_to = PeerCounts()  # requests per decode peer (control endpoint), for xPyD checks
        self._lock = threading.Lock()
        # rooms between their last chunk and the scheduler taking them (neither pending nor submitted)
        self._submitting: set[int] = set()
        # rooms SGLang failed before their Lynx transfer started -> decode endpoints told "quiet"
        self._quieted: OrderedDict[int, set[str]] = OrderedDict()
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

    # ----- called from SGLang's transfer worker -----
    def send_kvcache(self, manager: Any, session_id: str, prefill_kv_indices: Any, dst_kv_indices: Any) -> int:
        found = self._find_request(manager, session_id, dst_kv_indices)
        if found is None:
            logger.error("lynx: a chunk to %s matches no request of that decode session", session_id)
            return -1
        room, info, peer = found
        if peer is None or getattr(info, "lynx", None) is None:
            return self._refuse(manager, room, "the decode server sent no Lynx registration or metadata: start it "
                                               "with --lynx and the same --lynx-config as the prefill server")
        if isinstance(info.lynx.get("refused"), str):  # the decode failed it before sending a target
            return self._refuse(manager, room, info.lynx["refused"])
        problem = self._check_peer(manager, peer, info)
        if problem:
            return self._refuse(manager, room, problem)
        try:  # peer metadata: parsed and bounds-checked before anything is copied or sent
            target = RemoteTarget.from_dict(info.lynx["target"])
        except (TransferMetadataError, KeyError, TypeError) as exc:
            return self._refuse(manager, room, f"malformed Lynx target from the decode server: {exc}")
        total_pages = len(info.dst_kv_indices)
        tokens = info.lynx.get("tokens", total_pages if self.page_size == 1 else None)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or pages_for(tokens, self.page_size) != total_pages:
            return self._refuse(manager, room, f"the decode server's token count {tokens!r} does not fit its "
                                               f"{total_pages} pages of {self.page_size} tokens")
        # every slot of the chunk's pages: all but the last page of a request are full (SGLang's chunks end
        # on page boundaries); the last page's unused tail is cut off at submit (transport.pages)
        indices = token_slots(prefill_kv_indices, self.page_size)
        pending, streamed = None, None
        with self._lock:
            stale = self._drop_stale_locked()
            quieted = room in self._quieted  # its decode was told no byte will come: none may
            if not quieted:
                streamed = self._streamed.get(room)
                if streamed is None and room not in self._pending and len(prefill_kv_indices) < total_pages \
                        and self._part_coder is not None:
                    streamed = self._start_stream(room, tokens, target, peer["control"])
                if streamed is not None:
                    streamed.busy = True
                else:
                    pending = self._buffer_chunk(room, total_pages, tokens, target, peer["control"], indices,
                                                 len(prefill_kv_indices))
        for cleanup in stale:
            cleanup()
        if quieted:
            return self._refuse(manager, room, "the request failed before its Lynx transfer started")
        if streamed is not None:
            return self._stream_chunk(manager, room, streamed, indices, len(prefill_kv_indices))
        if pending is None:  # more chunks to come
            return 0
        try:
            if pending.pages != pending.total_pages:
                return self._refuse(manager, room,
                                    f"sent {pending.pages} pages, decode allocated {pending.total_pages}")
            return self._submit(manager, room, pending)
        finally:
            with self._lock:
                self._submitting.discard(room)

    def _buffer_chunk(self, room: int, total_pages: int, tokens: int, target: RemoteTarget, control: str,
                      indices: torch.Tensor, pages: int) -> _Pending | None:
        """Under the lock: copy a chunk of a buffered request; its ``_Pending`` once the last one came."""
        pending = self._pending.get(room)
        if pending is None:
            pending = _Pending(total_pages, tokens, target, control)
            self._pending[room] = pending
        pending.k_parts.append([layer[indices].clone() for layer in self.k_pool])
        pending.v_parts.append([layer[indices].clone() for layer in self.v_pool])
        pending.slots.append(indices)
        pending.pages += pages
        if pending.pages < pending.total_pages:
            return None
        del self._pending[room]
        self._submitting.add(room)
        return pending

    def on_room_failed(self, manager: Any, room: int) -> None:
        """SGLang failed or aborted ``room`` on this prefill (an abort while bootstrapping, a refusal, a
        lost decode). A room whose Lynx transfer never started will never have a byte written: each
        decode that reserved a region for it is told ``quiet`` now, so it frees the region at once
        instead of holding it for ``transfer_timeout_s`` (in the 30-minute soak each abort before the
        prefill's forward held an 18 MB region that long, and requests behind it timed out waiting for
        staging). From then on the room's chunks are refused. A started transfer quiets itself when its
        last write is done (``_on_quiet``). Called again for the same room (its decode's metadata came
        after the failure), only the decodes not told yet are told."""
        request_id = str(room)
        with self._lock:
            streamed = self._streamed.pop(room, None)
            if streamed is not None:  # its later chunks are refused; the transfer (if any) is aborted
                self._quieted[room] = set(_decode_endpoints(manager, room))
                self._over(streamed, "the request failed on the prefill while its KV was streamed")
                cleanup = self._take_cleanup(streamed)
        if streamed is not None:
            if cleanup is not None:
                cleanup()
            return
        with self._lock:
            if request_id in self._endpoints or room in self._submitting:
                return
            self._pending.pop(room, None)
            told = self._quieted.setdefault(room, set())
            self._quieted.move_to_end(room)
            while len(self._quieted) > MAX_QUIETED_ROOMS:
                self._quieted.popitem(last=False)
            endpoints = [e for e in _decode_endpoints(manager, room) if e not in told]
            told.update(endpoints)
        for endpoint in endpoints:
            logger.info("lynx: request %s failed before its transfer started: telling %s it is quiet",
                        room, endpoint)
            self.control.send(endpoint, {"type": "quiet", "request_id": request_id})

    # ----- streamed requests (prefill_stream) -----
    def _start_stream(self, room: int, tokens: int, target: RemoteTarget, control: str) -> StreamedRequest:
        """Under the lock: the room's first chunk, more to come: stream it."""
        heads, dim = int(self.k_pool[0].shape[1]), int(self.k_pool[0].shape[2])
        parts = PartEncoder(self._part_coder, len(self.k_pool), tokens, heads, dim)
        streamed = StreamedRequest.start(str(room), parts, target, control, self.k_pool[0], len(self.k_pool))
        self._streamed[room] = streamed
        self.requests_streamed += 1
        return streamed

    def _stream_chunk(self, manager: Any, room: int, streamed: StreamedRequest, slots: torch.Tensor,
                      pages: int) -> int:
        cleanup = None
        try:
            return self._stream_step(manager, room, streamed, slots, pages)
        finally:
            with self._lock:
                streamed.busy = False
                if streamed.state is StreamState.OVER:
                    cleanup = self._take_cleanup(streamed)
            if cleanup is not None:
                cleanup()

    def _stream_step(self, manager: Any, room: int, streamed: StreamedRequest, slots: torch.Tensor,
                     pages: int) -> int:
        request_id, allocated = streamed.request_id, pages_for(streamed.tokens, self.page_size)
        streamed.pages_seen += pages
        if streamed.pages_seen > allocated and streamed.state is StreamState.RECEIVING:
            with self._lock:
                streamed.refused = True
                self._over(streamed, "more pages than the decode allocated")
            return self._refuse(manager, room, f"sent {streamed.pages_seen} pages, decode allocated {allocated}")
        if streamed.state is StreamState.OVER:  # refused or failed at an earlier chunk: encode nothing
            if streamed.skip_chunk(slots):
                with self._lock:
                    if self._streamed.get(room) is streamed:
                        del self._streamed[room]
            return -1 if streamed.refused else 0
        last = streamed.add_chunk(self.k_pool, self.v_pool, slots)
        if streamed.lease is None:  # its first chunk: the whole request's send region, FIFO as ever
            sizes = stream_sizes(self.codec, KVShape.of_pool(self.k_pool), streamed.tokens)
            try:
                lease = self.send_alloc.allocate_wait(request_id, sizes, self.config.transfer_timeout_s)
            except Exception as exc:
                self.control.send(streamed.control, {"type": "quiet", "request_id": request_id})
                with self._lock:
                    streamed.refused = True
                    self._over(streamed, "no send region")
                what = "too small" if isinstance(exc, StagingTooLargeError) else "full"
                return self._refuse(manager, room, f"send arena {what}: {exc}")
            with self._lock:
                streamed.lease = lease
                if streamed.state is StreamState.OVER:  # failed while it waited: the caller cleans up
                    return 0
            self.page_reuse.forget(room)  # a streamed request's pages are encoded, not looked up
            streamed.fault = self.test_faults.pop(room, None)
        if last:
            dump_kv(f"prefill-{self.tp.dump_tag}{room}", streamed.k_layers, streamed.v_layers)
        part = streamed.next_part()
        if part is None:  # no codec page completed by this chunk
            return 0
        encode = self._part_encode(streamed, *part)
        if streamed.transfer is None:
            return self._stream_submit(manager, room, streamed, encode, last)
        if not self.scheduler.extend(streamed.transfer, encode):  # failed meanwhile: the decode was told
            with self._lock:
                self._over(streamed, "its transfer is over")
            return 0
        if last:
            self._stream_done(room, streamed)
        return 0

    def _part_encode(self, streamed: StreamedRequest, end_page: int, last: bool) -> Any:
        lease, request_id, first = streamed.lease, streamed.request_id, streamed.transfer is None
        fault = streamed.fault

        def region(kind: StreamKind) -> torch.Tensor:
            r = lease.regions[kind]
            return self.arena[r.addr - self.arena.data_ptr():][: r.capacity]

        def encode_exact() -> LocalBuffer:  # on the scheduler's exact thread, while the others are sent
            anchor = region(StreamKind.ANCHOR)[: streamed.parts.anchor_bytes]
            n = encode_exact_stream(streamed.k_layers, streamed.v_layers, anchor, streamed.scratch, self.codec,
                                    region(StreamKind.EXACT))
            return LocalBuffer(lease.regions[StreamKind.EXACT].addr, n)

        exact = encode_exact if last and StreamKind.EXACT in lease.regions else None
        on_start = (lambda: transport_faults.on_encode_start(fault, request_id)) if first else None
        return streamed.part_encode(end_page, last, region, exact, on_start)

    def _stream_submit(self, manager: Any, room: int, streamed: StreamedRequest, encode: Any, last: bool) -> int:
        request_id, lease = streamed.request_id, streamed.lease
        kinds = set(lease.regions)
        with self._lock:
            self._endpoints[request_id] = streamed.control
            if streamed.fault is not None:
                self._faults[request_id] = (streamed.fault, streamed.target, lease)
        self.sent_to.start(streamed.control)
        try:
            transfer = self.scheduler.submit(request_id, streamed.target, encode,
                                             progressive=StreamKind.RESIDUAL in kinds, exact=StreamKind.EXACT in kinds)
        except Exception as exc:  # closed, unhealthy or queue full: this request fails, nothing was sent
            with self._lock:
                self._endpoints.pop(request_id, None)
                self._faults.pop(request_id, None)
                streamed.refused = True
                self._over(streamed, "the transfer scheduler refused it")
            self.sent_to.end(streamed.control)
            return self._refuse(manager, room, f"the Lynx transfer scheduler refused the request: {exc}")
        transfer.quiet.add_done_callback(lambda _f: self._on_quiet(request_id))
        with self._lock:
            streamed.transfer = transfer
        if last:
            self._stream_done(room, streamed)
        return 0

    def _stream_done(self, room: int, streamed: StreamedRequest) -> None:
        """Its last part is queued: the scheduler owns the rest (quiet frees the region)."""
        with self._lock:
            if streamed.state is StreamState.RECEIVING:
                streamed.state = StreamState.SUBMITTED
            if self._streamed.get(room) is streamed:
                del self._streamed[room]

    @staticmethod
    def _over(streamed: StreamedRequest, reason: str) -> None:
        """Under the lock: no more parts for ``streamed`` (cleaned up by whoever holds it last)."""
        if streamed.state is StreamState.RECEIVING:
            streamed.state, streamed.why_over = StreamState.OVER, reason

    def _take_cleanup(self, streamed: StreamedRequest) -> Any:
        """Under the lock: what frees an over request's region, once, to run outside the lock (None: nothing
        to do now). A submitted transfer is aborted (its quiet frees the region); a region that no part
        used is freed at once and its decode told ``quiet``."""
        if streamed.busy or streamed.cleaned:
            return None
        streamed.cleaned = True
        transfer, lease, reason = streamed.transfer, streamed.lease, streamed.why_over
        if transfer is not None:
            return lambda: self.scheduler.abort(transfer, reason)
        if lease is None:
            return None

        def free() -> None:
            self.send_alloc.release(streamed.request_id)
            self.control.send(streamed.control, {"type": "quiet", "request_id": streamed.request_id})

        return free

    def refuse_tp_mismatch(self, manager: Any, session_id: str, dst_kv_indices: Any, decode_tp: int) -> int:
        """SGLang's path for a decode with another TP size (``send_kvcache_slice``): fail the request."""
        found = self._find_request(manager, session_id, dst_kv_indices)
        reason = tp_mismatch_reason(self.tp.size, decode_tp)
        if found is None:
            logger.error("lynx: a chunk to %s: %s", session_id, reason)
            return -1
        return self._refuse(manager, found[0], reason)

    @staticmethod
    def _refuse(manager: Any, room: int, reason: str) -> int:
        """Fail the request's chunk (-1) with ``reason`` as SGLang's root cause: SGLang keeps the first
        recorded failure of a room and sends it to the decode side, which puts it in the client's error."""
        logger.error("lynx: request %s: %s", room, reason)
        refused = getattr(manager, "lynx_refused_rooms", None)
        if refused is not None:  # not a dead session: the manager forgives it (kv_manager.conclude_failure)
            if len(refused) >= MAX_REFUSED_ROOMS:  # conclude_failure pops each; a bound all the same
                refused.pop(next(iter(refused)))
            refused[room] = reason
        record = getattr(manager, "record_failure", None)
        if record is not None:
            record(room, f"sglang-lynx: {reason}")
        return -1

    def _drop_stale_locked(self) -> list[Any]:
        """Chunks of a request whose last chunk never came (aborted mid-prefill) are dropped after
        ``transfer_timeout_s`` so the copied KV does not leak; a streamed one's transfer is aborted (the
        returned cleanups, run outside the lock)."""
        now = time.monotonic()
        for room in [r for r, p in self._pending.items() if now - p.started > self.config.transfer_timeout_s]:
            logger.warning("lynx: dropping the partial KV of request %s (its last chunk never came)", room)
            del self._pending[room]
        cleanups = []
        for room, streamed in list(self._streamed.items()):
            if streamed.busy or now - streamed.started <= self.config.transfer_timeout_s:
                continue
            logger.warning("lynx: request %s: its last chunk never came; its streamed transfer is aborted", room)
            del self._streamed[room]
            self._over(streamed, "its last prefill chunk never came")
            cleanups.append(self._take_cleanup(streamed))
        return [c for c in cleanups if c is not None]

    @staticmethod
    def _find_request(manager: Any, session_id: str, dst_kv_indices: Any) -> tuple[int, Any, dict | None] | None:
        return find_chunk_owner(manager, session_id, dst_kv_indices)

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

    def _submit(self, manager: Any, room: int, pending: _Pending) -> int:
        n = pending.total_tokens  # the request's tokens, without the unused tail of its last page
        k_layers = [torch.cat([part[i] for part in pending.k_parts])[:n] for i in range(len(self.k_pool))]
        v_layers = [torch.cat([part[i] for part in pending.v_parts])[:n] for i in range(len(self.v_pool))]
        dump_kv(f"prefill-{self.tp.dump_tag}{room}", k_layers, v_layers)
        reuse = self.page_reuse.keys_for(room, torch.cat(pending.slots)[:n])  # while the slots are still ours
        tokens, heads, dim = (int(s) for s in k_layers[0].shape)
        sizes = stream_sizes(self.codec, KVShape(len(k_layers), heads, dim), tokens)
        two_streams, exact = StreamKind.RESIDUAL in sizes, StreamKind.EXACT in sizes
        request_id = str(room)
        try:  # FIFO wait for space (module docstring): blocks this transfer worker, bounded
            lease = self.send_alloc.allocate_wait(request_id, sizes, self.config.transfer_timeout_s)
        except Exception as exc:
            # nothing was written to the decode's region: it may free it at once when the request fails
            self.control.send(pending.control, {"type": "quiet", "request_id": request_id})
            what = "too small" if isinstance(exc, StagingTooLargeError) else "full"
            return self._refuse(manager, room, f"send arena {what}: {exc}")

        fault = self.test_faults.pop(room, None)
        if fault is not None:
            with self._lock:
                self._faults[request_id] = (fault, pending.target, lease)

        def region_view(kind: StreamKind) -> torch.Tensor:
            region = lease.regions[kind]
            return self.arena[region.addr - self.arena.data_ptr():][: region.capacity]

        def encode() -> EncodedObject:
            transport_faults.on_encode_start(fault, request_id)
            anchor, residual = encode_request_streams(k_layers, v_layers, self.codec, self.config, reuse)
            body = residual_to_wire(residual, self.codec, len(k_layers), tokens, heads, dim) if two_streams else None
            buffers = {}
            for kind, data in ((StreamKind.ANCHOR, anchor), (StreamKind.RESIDUAL, body)):
                if kind not in sizes or data is None:
                    continue
                region_view(kind)[: data.numel()].copy_(data)
                buffers[kind] = LocalBuffer(lease.regions[kind].addr, data.numel())

            def encode_exact() -> LocalBuffer:  # on the scheduler's exact thread, while the others are sent
                n = encode_exact_stream(k_layers, v_layers, anchor, residual, self.codec,
                                        region_view(StreamKind.EXACT))
                return LocalBuffer(lease.regions[StreamKind.EXACT].addr, n)

            return EncodedObject(buffers[StreamKind.ANCHOR], buffers.get(StreamKind.RESIDUAL),
                                 encode_exact if exact else None)

        with self._lock:
            self._endpoints[request_id] = pending.control
        self.sent_to.start(pending.control)
        try:
            transfer = self.scheduler.submit(request_id, pending.target, encode, progressive=two_streams, exact=exact)
        except Exception as exc:  # closed, unhealthy or queue full: this request fails, nothing was sent
            with self._lock:
                self._endpoints.pop(request_id, None)
                self._faults.pop(request_id, None)
            self.sent_to.end(pending.control)
            self.send_alloc.release(request_id)
            return self._refuse(manager, room, f"the Lynx transfer scheduler refused the request: {exc}")
        transfer.quiet.add_done_callback(lambda _f: self._on_quiet(request_id))
        return 0

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

    def unhealthy_reason(self) -> str | None:
        """Why this transport cannot serve as it should (a scheduler thread stopped, ...), None if healthy."""
        return self.scheduler.unhealthy_reason()

    def snapshot(self) -> dict[str, Any]:
        """Occupancy for ``/get_server_info`` (idle: staging all free, nothing pending or in progress) and
        health (``unhealthy_reason``, internal error counts)."""
        with self._lock:
            pending, in_progress, streamed = len(self._pending), len(self._endpoints), len(self._streamed)
        return {"role": "prefill", "mode": self.config.mode, "tp_rank": self.tp.rank, "tp_size": self.tp.size,
                **self.scheduler.health.snapshot(),
                "control_failed_sends": self.control.failed_sends, "control_peers": self.control.peers(),
                "staging": self.send_alloc.stats(),
                "registered_bytes": self.engine.registered_bytes, "abandoned_writes": self.engine.abandoned_writes,
                "forgotten_writes": self.scheduler.abandoned.forgotten,
                "pending_requests": pending, "transfers_in_progress": in_progress, "streamed_requests": streamed,
                "requests_streamed": self.requests_streamed,
                "live_transfers": self.scheduler.live()[:8], "sent_to": self.sent_to.snapshot(),
                "page_cache": self.page_reuse.stats(),
                "link_gbps": self.pacer.gbps if self.pacer is not None else None}

    def close(self) -> None:
        self.page_reuse.detach()
        self.scheduler.close()
        self.control.close()
        self.engine.close()
