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

:class:`LynxPrefillSide` (here: SGLang's entry points) is assembled from ``prefill_base`` (state, send
arena, scheduler callbacks), ``prefill_buffered`` (steps 1-2 for a buffered request),
``prefill_streaming`` (a streamed one) and ``prefill_peers`` (chunk owner, refusals).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lynx.integration.transport.pages import token_slots
from sglang_lynx.integration.transport.prefill_base import LINK_ENV, Pending, pacer_from_env
from sglang_lynx.integration.transport.prefill_buffered import BufferedChunks
from sglang_lynx.integration.transport.prefill_layers import LayerGroups
from sglang_lynx.integration.transport.prefill_peers import (
    MAX_REFUSED_ROOMS,
    decode_endpoints,
    find_chunk_owner,
    refuse,
    sglang_tracks,
    tp_mismatch_reason,
)

logger = logging.getLogger("sglang_lynx.transport")

MAX_QUIETED_ROOMS = 4096
__all__ = ["LINK_ENV", "MAX_QUIETED_ROOMS", "MAX_REFUSED_ROOMS", "LynxPrefillSide", "Pending", "find_chunk_owner",
           "pacer_from_env", "tp_mismatch_reason"]


class LynxPrefillSide(LayerGroups, BufferedChunks):
    """SGLang's entry points on a prefill server: chunks in (``send_kvcache``), failures, health."""

    # ----- called from SGLang's transfer worker -----
    def send_kvcache(self, manager: Any, session_id: str, prefill_kv_indices: Any, dst_kv_indices: Any) -> int:
        found = self._find_request(manager, session_id, dst_kv_indices)
        if found is None:
            logger.error("lynx: a chunk to %s matches no request of that decode session", session_id)
            return -1
        try:
            return self._send_chunk(manager, found, prefill_kv_indices)
        finally:
            with self._lock:  # its region is taken (or it failed) unless it is buffered with more chunks to come
                if found[0] not in self._pending:
                    self._unsent.pop(found[0], None)

    def _send_chunk(self, manager: Any, found: tuple[int, Any, dict | None], prefill_kv_indices: Any) -> int:
        room, info, peer = found
        resolved = self._resolve_target(manager, info, peer)
        if isinstance(resolved, str):
            return refuse(manager, room, resolved)
        target, tokens, total_pages, control = resolved
        self._announce(room, control)  # before SGLang hears this chunk is done (each chunk: idempotent there)
        # every slot of the chunk's pages: all but the last page of a request are full (SGLang's chunks end
        # on page boundaries); the last page's unused tail is cut off at submit (transport.pages)
        indices = token_slots(prefill_kv_indices, self.page_size)
        pending, streamed = None, None
        with self._lock:
            stale = self._drop_stale_locked(manager, room)
            quieted = room in self._quieted  # its decode was told no byte will come: none may
            if not quieted:
                streamed = self._streamed.get(room)
                if streamed is None and room not in self._pending and len(prefill_kv_indices) < total_pages \
                        and self._part_coder is not None:
                    streamed = self._start_stream(room, tokens, target, control)
                if streamed is not None:
                    streamed.enter()
                else:
                    pending = self._buffer_chunk(room, total_pages, tokens, target, control, indices,
                                                 len(prefill_kv_indices))
        for cleanup in stale:
            cleanup()
        if quieted:
            return refuse(manager, room, "the request failed before its Lynx transfer started")
        if streamed is not None:
            return self._stream_chunk(manager, room, streamed, indices, len(prefill_kv_indices))
        if pending is None:  # more chunks to come
            return 0
        try:
            if pending.pages != pending.total_pages:
                return refuse(manager, room,
                              f"sent {pending.pages} pages, decode allocated {pending.total_pages}")
            return self._submit(manager, room, pending)
        finally:
            with self._lock:
                self._submitting.discard(room)

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
            self._unsent.pop(room, None)
            streamed = self._streamed.pop(room, None)
            if streamed is not None:  # its later chunks are refused; the transfer (if any) is aborted
                self._quieted[room] = set(decode_endpoints(manager, room))
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
            endpoints = [e for e in decode_endpoints(manager, room) if e not in told]
            told.update(endpoints)
        for endpoint in endpoints:
            logger.info("lynx: request %s failed before its transfer started: telling %s it is quiet",
                        room, endpoint)
            self.control.send(endpoint, {"type": "quiet", "request_id": request_id})

    def refuse_tp_mismatch(self, manager: Any, session_id: str, dst_kv_indices: Any, decode_tp: int) -> int:
        """SGLang's path for a decode with another TP size (``send_kvcache_slice``): fail the request."""
        found = self._find_request(manager, session_id, dst_kv_indices)
        reason = tp_mismatch_reason(self.tp.size, decode_tp)
        if found is None:
            logger.error("lynx: a chunk to %s: %s", session_id, reason)
            return -1
        return refuse(manager, found[0], reason)

    def _drop_stale_locked(self, manager: Any, current: int) -> list[Any]:
        """Chunks of a request whose last chunk never came (aborted mid-prefill without SGLang saying so:
        a failed or aborted room reaches ``on_room_failed``) are dropped so the copied KV does not leak; a
        streamed one's transfer is aborted (the returned cleanups, run outside the lock). Stale: no chunk of
        it came (nor did a thread work on one) for ``transfer_timeout_s`` and SGLang no longer tracks it
        (``sglang_tracks``). Not the request's age: a prompt whose prefill takes longer than
        ``transfer_timeout_s`` (long prompts on a slow host: one 4,096-token chunk took 62 s on this 2-core VM,
        and its own hand-over then aborted its transfer) is alive. ``current``: the room whose chunk is
        being handed over now."""
        now, limit = time.monotonic(), self.config.transfer_timeout_s

        def stale(room: int, active: float) -> bool:
            return room != current and now - active > limit and not sglang_tracks(manager, room)

        for room in [r for r, p in self._pending.items() if stale(r, p.active)]:
            logger.warning("lynx: dropping the partial KV of request %s (its last chunk never came)", room)
            del self._pending[room]
        cleanups = []
        for room, streamed in list(self._streamed.items()):
            if streamed.busy or not stale(room, streamed.active):
                continue
            logger.warning("lynx: request %s: its last chunk never came; its streamed transfer is aborted", room)
            del self._streamed[room]
            self._over(streamed, "its last prefill chunk never came")
            cleanups.append(self._take_cleanup(streamed))
        return [c for c in cleanups if c is not None]

    @staticmethod
    def _find_request(manager: Any, session_id: str, dst_kv_indices: Any) -> tuple[int, Any, dict | None] | None:
        return find_chunk_owner(manager, session_id, dst_kv_indices)

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
                "requests_layered": self.requests_layered, "pending_requests": pending,
                "transfers_in_progress": in_progress, "streamed_requests": streamed,
                "requests_streamed": self.requests_streamed,
                "live_transfers": self.scheduler.live()[:8], "sent_to": self.sent_to.snapshot(),
                "page_cache": self.page_reuse.stats(),
                "link_gbps": self.pacer.gbps if self.pacer is not None else None}

    def close(self) -> None:
        self.page_reuse.detach()
        self.scheduler.close()
        self.control.close()
        self.engine.close()
