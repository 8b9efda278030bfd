"""Decode side of the Lynx transport: staging arena, per-request progress, dequantization into the pool.

Lifecycle of one request (bootstrap room), driven by the Lynx receiver inside SGLang's decode loop:

1. ``expect(room, kv_indices)`` (from ``send_metadata``): the request asks for staging for its anchor
   and residual in the registered arena (``LynxConfig.receive_arena_mb``, sized at ``attach_pool``;
   sizes from shapes alone). If it is its turn and the space is free, it is reserved at once and
   SGLang's metadata goes out with the remote target in its Lynx frame. Otherwise the receiver holds
   the metadata back and ``reserve(room)`` (every poll) retries in FIFO order; the metadata goes out
   when the region is reserved. The prefill does not compute a request before it has its metadata,
   so staging is reserved only for requests the arena can take now: a request waiting for space holds
   its decode KV slots but no staging, and nothing at the prefill. A region is held from then until
   the request's KV is in the pool, the prefill's forward included, so under load the queue moves at
   the pace of prefills: the request waits as long as the arena turns over, and fails (naming the
   field) only once no region at all was freed for ``transfer_timeout_s`` (the arena is stuck) or
   after ``STAGING_WAIT_CAP`` x ``transfer_timeout_s`` in all; a request larger than the whole arena
   fails at once. (An absolute ``transfer_timeout_s`` failed requests queued behind a cold prefill
   that was busy, not stuck: 22 in the 30-minute soak, right after its prefill restart.)
2. Control notices arrive on the control thread: ``accepted`` (a Lynx prefill took the request),
   ``landed`` (checked against size and crc32 before the bytes are trusted), ``failed``, ``quiet``,
   ``progress``.
3. ``poll(room)`` (scheduler thread, every loop): ``PENDING`` until every stream the mode needs has
   landed; then the request's KV is dequantized from staging straight into its pool slots, the
   staging region is released, and ``DONE`` is returned once. Any failure (checksum, size, sender
   lost, timeout: ``transfer_timeout_s`` overall and ``residual_timeout_s`` after the anchor; SGLang's
   success (``arm``) with neither ``accepted`` nor the anchor for ``accept_grace_s``, i.e. a prefill
   without ``--lynx``) gives ``FAILED`` with the reason, and the region stays quarantined until the
   sender is quiet or the hold time passes, so no later request can receive stale bytes.
4. ``abort(room)`` at any time: the same quarantine.

Progress per request (:class:`InboundProgress`) is what the speculative decoder reads: anchor landed,
residual landed, failure, and the two pool writes (anchor-only, then the full upgrade).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.arena import Arena, KVShape, build_arena, stream_sizes
from sglang_lynx.integration.transport.exact_prefetch import PrefetchBudget
from sglang_lynx.integration.transport.inbound import InboundProgress
from sglang_lynx.integration.transport.pages import PageLayoutError, token_slots
from sglang_lynx.integration.transport.wire import TpRank, config_fingerprint, encode_field
from sglang_lynx.transfer.control import ControlServer
from sglang_lynx.transfer.peer_counts import PeerCounts
from sglang_lynx.transfer.receiver import InboundState, ReceiveTracker
from sglang_lynx.transfer.staging import StagingFullError
from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind

__all__ = ["InboundProgress", "LynxDecodeSide", "Verdict"]

logger = logging.getLogger("sglang_lynx.transport")
MAX_REFUSALS = 1024  # refusals whose metadata message never went out, kept at most

UNARMED_TIMEOUT_S = 24 * 3600.0
# a Lynx prefill says ``accepted`` before it reports a request done to SGLang; a success without that notice
# for this long (at most transfer_timeout_s) comes from a prefill without --lynx: the request fails then
ACCEPT_GRACE_S = 10.0
NO_LYNX_PREFILL_HINT = ("(no Lynx stream came from the prefill server: is it started with --lynx and the same "
                        "--lynx-config?)")
STAGING_WAIT_CAP = 4  # x transfer_timeout_s: the longest a request waits for staging, however busy


class Verdict(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class LynxDecodeSide:
    def __init__(self, config: LynxConfig, host: str, tp: TpRank | None = None, transport: Any = None) -> None:
        """``tp``: this server's TP rank; ``transport``: the Mooncake protocol and devices
        (``transport.protocol``; None: TCP)."""
        from sglang_lynx.transfer.mooncake_engine import TCP, MooncakeEngine

        self.config = config
        self.tp = tp or TpRank()
        self.codec = get_codec(config.codec_name, **config.codec_params())
        self.two_streams = bool(self.codec.two_streams)
        self.engine = MooncakeEngine.start(host, transport or TCP)
        self._arena: Arena | None = None  # built by attach_pool, once the KV pool exists
        self._tracker: ReceiveTracker | None = None
        self.control = ControlServer(host, self._on_message)
        self.k_pool: list[torch.Tensor] = []
        self.v_pool: list[torch.Tensor] = []
        self.page_size = 1  # SGLang's KV page size (attach_pool)
        self.inbound: dict[int, InboundProgress] = {}
        self._targets: dict[int, dict[str, Any]] = {}
        # room -> why the decode refused it before its metadata went out; popped when the refusal
        # rides on SGLang's metadata message, bounded (a message that never went out is forgotten)
        self._refusals: dict[int, str] = {}
        self.received_from = PeerCounts()  # requests per prefill (bootstrap address), for xPyD checks
        self._lock = threading.Lock()
        # one worker restores lynx-exact KV while it lands and a drafting request's full KV once its last
        # stream landed (InboundProgress.on_progress / prepare_full), within this budget of private tensors
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lynx-upgrade")
        self.prefetch_budget = PrefetchBudget(config.exact_prefetch_mb << 20)
        self.accept_grace_s = min(ACCEPT_GRACE_S, config.transfer_timeout_s)

    def attach_pool(self, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], pool_tokens: int,
                    max_request_tokens: int, page_size: int = 1) -> None:
        """The KV pool exists: size and register the receive arena (LynxConfigError: start-up refused).
        ``page_size``: SGLang's (``--page-size``), for the log; each request names its own in ``expect``."""
        self.k_pool, self.v_pool, self.page_size = list(k_pool), list(v_pool), int(page_size)
        if self._arena is None:
            self._arena = build_arena(self.config, "receive", self.codec, self.engine, self.k_pool, pool_tokens,
                                      max_request_tokens)
            self._tracker = ReceiveTracker(self._arena.allocator, quarantine_s=self.config.transfer_timeout_s)

    @property
    def tracker(self) -> ReceiveTracker:
        if self._tracker is None:
            raise RuntimeError("Lynx decode side has no KV pool attached (no receive arena yet)")
        return self._tracker

    # ----- bootstrap frames -----
    def registration_field(self) -> bytes:
        arena = self._arena
        if arena is None:
            raise RuntimeError("Lynx decode side has no KV pool attached (no receive arena yet)")
        return encode_field({
            "session": self.engine.session_id, "arena_addr": arena.addr,
            "arena_bytes": arena.size.arena_bytes, "control": self.control.endpoint,
            "fingerprint": config_fingerprint(self.config),
        })

    def metadata_field(self, room: int) -> bytes | None:
        with self._lock:
            target = self._targets.pop(room, None)
            refusal = self._refusals.pop(room, None)
            progress = self.inbound.get(room)
            target_tokens = None if progress is None else int(progress.slots.numel())
        if refusal is not None:
            return encode_field({"refused": refusal})
        # the token count: with pages > 1 the prefill cannot tell it from the page lists (transport.pages)
        return None if target is None else encode_field({"target": target, "tokens": target_tokens})

    def refuse(self, room: int, reason: str) -> None:
        """The request failed here before its metadata went out: the next metadata message for ``room``
        tells the prefill why (it then fails the request at once instead of waiting for metadata until
        SGLang's bootstrap timeout, which left the client without an answer)."""
        with self._lock:
            self._targets.pop(room, None)
            self._refusals[room] = reason
            while len(self._refusals) > MAX_REFUSALS:
                self._refusals.pop(next(iter(self._refusals)))

    # ----- per request -----
    def expect(self, room: int, kv_indices: Any, source: str | None = None, *, page_size: int = 1,
               tokens: int | None = None) -> bool:
        """Track the request and ask for its staging; True when reserved (send the metadata now), False
        when it waits its turn (``reserve`` again later). Raises when it can never fit.

        ``kv_indices``: SGLang's page indices of the request's KV (token slots at page size 1);
        ``tokens``: how many tokens they hold (the last page may be partial, ``transport.pages``);
        needed when ``page_size > 1``."""
        if not self.k_pool:
            raise RuntimeError("Lynx decode side has no KV pool attached")
        if tokens is None and page_size > 1:
            raise PageLayoutError(f"page size {page_size}: the request's token count did not reach the Lynx "
                                  "receiver (hook on DecodePreallocQueue._transfer_page_indices)")
        slots = token_slots(kv_indices, page_size, tokens)
        progress = InboundProgress(room, slots, self, source=source,
                                   sizes=stream_sizes(self.codec, KVShape.of_pool(self.k_pool), int(slots.numel())))
        with self._lock:
            self.inbound[room] = progress
        self.received_from.start(source)
        try:
            return self.reserve(room)
        except Exception:
            self.forget(room)
            raise

    def reserve(self, room: int) -> bool:
        """FIFO turn for the request's staging: True once reserved (the target is then in the metadata),
        False while it waits; StagingFullError after ``transfer_timeout_s`` of waiting."""
        progress = self.inbound.get(room)
        if progress is None:
            raise RuntimeError(f"request {room} is not expected by the Lynx decode side")
        if progress.reserved:
            return True
        residual_timeout = self.config.residual_timeout_s if StreamKind.RESIDUAL in progress.sizes else None
        # Until the prefill has computed the request (SGLang's own first-token success, see arm()),
        # SGLang's timeouts govern: a request queued behind others must not time out here.
        req = self.tracker.try_expect(str(room), progress.sizes, UNARMED_TIMEOUT_S, residual_timeout)
        if req is None:
            allocator, limit = self.tracker.allocator, self.config.transfer_timeout_s
            now = time.monotonic()
            waited, stuck = now - progress.created, now - max(progress.created, allocator.last_freed)
            if stuck > limit or waited > STAGING_WAIT_CAP * limit:
                allocator.cancel_wait(str(room))
                why = (f"no region freed for {stuck:.0f} s (transfer_timeout_s {limit:g})" if stuck > limit
                       else f"{STAGING_WAIT_CAP} x transfer_timeout_s ({limit:g} s)")
                raise StagingFullError(
                    f"waited {waited:.0f} s for staging, {why}: the decode's receive arena "
                    f"(receive_arena_mb, {allocator.arena_bytes} bytes) stayed full")
            return False
        with self._lock:
            self._targets[room] = req.lease.target(self.engine.session_id).to_dict()
            progress.reserved = True
        return True

    def arm(self, room: int) -> None:
        """The prefill has finished the request (SGLang reported success): its streams must now land
        within ``transfer_timeout_s``. Idempotent."""
        progress = self.inbound.get(room)
        if progress is not None and progress.armed_at is None:
            progress.armed_at = time.monotonic()
            self.tracker.tighten_deadline(str(room), self.config.transfer_timeout_s)

    def poll(self, room: int, *, need_residual: bool = True) -> tuple[Verdict, str]:
        """Advance one request; DONE (KV in the pool) is returned once, then the request is forgotten."""
        self.tracker.expire()
        self._sweep()
        progress = self.inbound.get(room)
        if progress is None:
            return Verdict.FAILED, f"request {room} has no Lynx transfer"
        failure = progress.failure()
        # anchor-only admission (mode lynx): a residual (or exact stream) that failed before the first poll
        # does not fail the request; the anchor is admitted and the decode hooks take the residual fallback.
        # A later stream may fail before the anchor lands (lynx-exact: an exact piece too large for its
        # region, while the prefill still runs): the anchor is then still awaited, until its deadline.
        if failure is not None and not need_residual and progress.anchor_awaited():
            return Verdict.PENDING, ""
        if failure is not None and (need_residual or not progress.anchor_landed()):
            anchor_never_came = not progress.anchor_landed() and "timeout" in failure
            self.forget(room)
            hint = f" {NO_LYNX_PREFILL_HINT}" if anchor_never_came else ""
            return Verdict.FAILED, f"Lynx transfer failed: {failure}{hint}"
        if self._never_accepted(progress):
            reason = (f"the prefill server reported the request done but sent no Lynx notice within "
                      f"{self.accept_grace_s:g} s {NO_LYNX_PREFILL_HINT}")
            self.abort(room, reason)
            return Verdict.FAILED, f"Lynx transfer failed: {reason}"
        landed = progress.residual_landed() if need_residual else progress.anchor_landed()
        if not landed:
            return Verdict.PENDING, ""
        try:
            progress.decode_into_pool(with_residual=need_residual)
        except Exception as exc:  # a payload that does not decode is a failed transfer, not a crash
            logger.exception("lynx: request %s: decode into the pool failed", room)
            self.abort(room, f"decode failed: {exc}")
            return Verdict.FAILED, f"Lynx payload did not decode: {exc}"
        if need_residual:
            self.forget(room)
        return Verdict.DONE, ""

    def _never_accepted(self, progress: InboundProgress) -> bool:
        """SGLang reported the request done ``accept_grace_s`` ago and neither an ``accepted`` notice nor
        the anchor came: its prefill is not a Lynx one (``PrefillSideBase._announce``)."""
        return (progress.armed_at is not None and not progress.accepted and not progress.anchor_landed()
                and time.monotonic() - progress.armed_at > self.accept_grace_s)

    def _sweep(self) -> None:
        """Drop requests whose receiver went away without finishing them (their transfer deadline is
        long past): the staging stays quarantined until the sender is quiet."""
        horizon = 2 * self.config.transfer_timeout_s + self.config.residual_timeout_s
        now = time.monotonic()
        with self._lock:
            stale = [room for room, p in self.inbound.items()
                     if (p.armed_at is not None and now - p.armed_at > horizon)
                     or (not p.reserved and now - p.created > horizon)]
        for room in stale:
            logger.warning("lynx: request %s was never collected; releasing its transfer", room)
            self.abort(room, "never collected")

    def on_prefill_lost(self, bootstrap_addr: str) -> list[int]:
        """SGLang's heartbeat lost the prefill at ``bootstrap_addr``: every stream of its requests that has
        not landed fails now (instead of at its deadline); mode lynx then takes its residual fallback."""
        with self._lock:
            rooms = [room for room, p in self.inbound.items() if p.source == bootstrap_addr]
        hit = []
        for room in rooms:
            req = self.tracker.get(str(room))
            anchor_awaited = req is not None and req.states.get(StreamKind.ANCHOR) is InboundState.EXPECTED
            if req is None or req.complete or (req.failed and not anchor_awaited):
                continue
            kind = StreamKind.RESIDUAL if req.anchor_landed else StreamKind.ANCHOR
            self.tracker.on_sender_failed(str(room), kind, f"prefill {bootstrap_addr} lost (heartbeat)")
            hit.append(room)
        if hit:
            logger.error("lynx: prefill %s lost: %d Lynx transfer(s) failed", bootstrap_addr, len(hit))
        return hit

    def forget(self, room: int) -> None:
        with self._lock:
            progress = self.inbound.pop(room, None)
            self._targets.pop(room, None)
        self.tracker.allocator.cancel_wait(str(room))
        if progress is not None:
            progress.release()
            self.received_from.end(progress.source)
        self.tracker.finish(str(room))

    def abort(self, room: int, reason: str = "aborted") -> None:
        if self.tracker.get(str(room)) is not None:
            self.tracker.abort(str(room), reason)
        self.forget(room)

    # ----- control thread -----
    def _on_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "landed":
            desc = StreamDescriptor.from_dict(msg["desc"])
            if self.tracker.get(desc.request_id) is None:  # already failed/aborted and forgotten
                logger.info("lynx: late landed notice for request %s ignored", desc.request_id)
                return
            self.tracker.on_landed(desc)
            self._prepare_if_complete(desc.request_id)
        elif msg["type"] == "failed":
            self.tracker.on_sender_failed(str(msg["request_id"]), StreamKind(msg["stream"]), str(msg["reason"]))
        elif msg["type"] == "quiet":
            self.tracker.on_sender_quiet(str(msg["request_id"]))
        elif msg["type"] == "progress":
            self._on_progress(str(msg["request_id"]), StreamKind(msg["stream"]), msg["spans"])
        elif msg["type"] == "accepted":
            progress = self._progress_of(str(msg["request_id"]))
            if progress is not None:
                progress.accepted = True

    def _on_progress(self, request_id: str, kind: StreamKind, spans: list[tuple[int, int]]) -> None:
        """A part of a lynx-exact request is in place: restore what it allows on the worker (``exact_prefetch``)."""
        if self.tracker.on_progress(request_id, kind, spans) is not None:
            self._on_worker(request_id, lambda p: p.on_progress(self._prepare, self.prefetch_budget),
                            "not restored ahead")

    def _prepare_if_complete(self, request_id: str) -> None:
        """Every stream of a drafting request landed: start decoding its full KV off the scheduler thread."""
        req = self.tracker.get(request_id)
        if req is None or not req.complete or req.failed:
            return
        self._on_worker(request_id, lambda p: p.prepare_full(self._prepare), "upgrade not prepared")

    def _progress_of(self, request_id: str) -> InboundProgress | None:
        """The inbound request a control notice names (its request id is the room), if it is still here."""
        with self._lock:
            return self.inbound.get(int(request_id)) if request_id.isdigit() else None

    def _on_worker(self, request_id: str, start: Callable[[InboundProgress], object], otherwise: str) -> None:
        """``start`` the request's work on the worker, if it is still here; once the side is closing (its
        worker shut down), the work is done later where it is needed (``otherwise`` says what did not)."""
        progress = self._progress_of(request_id)
        if progress is None:
            return
        try:
            start(progress)
        except RuntimeError as exc:
            logger.info("lynx: request %s: %s (%s)", request_id, otherwise, exc)

    def unhealthy_reason(self) -> str | None:
        """Why this transport cannot serve as it should (the control thread stopped, ...), None if healthy."""
        return self.control.unhealthy_reason()

    def snapshot(self) -> dict[str, Any]:
        """Occupancy for ``/get_server_info`` (idle: staging all free, no request tracked) and health
        (``unhealthy_reason``, internal error counts)."""
        self.tracker.allocator.reclaim_expired()  # quarantined regions whose hold has passed
        with self._lock:
            inbound = len(self.inbound)
        return {"role": "decode", "mode": self.config.mode, "tp_rank": self.tp.rank, "tp_size": self.tp.size,
                **self.control.health.snapshot(),
                "control_dropped": self.control.dropped, "staging": self.tracker.allocator.stats(),
                "registered_bytes": self.engine.registered_bytes, "inbound_requests": inbound,
                "control_endpoint": self.control.endpoint, "received_from": self.received_from.snapshot(),
                "tracked_requests": self.tracker.active()}

    def close(self) -> None:
        self.control.close()
        self._prepare.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
