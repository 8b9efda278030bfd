"""Layer groups: a request's KV queued while the prefill's forward still computes its later layers.

SGLang's forward writes a chunk's KV one layer after another (``set_kv_buffer``); stock SGLang (and the
chunk-streamed path, ``prefill_stream``) hands the chunk to the transfer worker only after the last
layer. With ``LynxConfig.stream_layer_group = g > 0`` the prefill side is told, by hooks owned by
``prefill_layer_hooks``, when a batch's forward starts (:meth:`LayerGroups.begin_forward`: each
request's token range and KV slots in this chunk), each time a group of ``g`` layers has been written
(:meth:`LayerGroups.layers_written`) and when the forward is over (:meth:`LayerGroups.end_forward`). For a
**layered** request, each group's rows are copied out of the pool and the group's full codec pages are
queued at once as one part (``PartEncoder.encode_part(..., layers=group)``), the first part submitting
the transfer; so the anchor of the first layers is on the wire while the last layers are computed.
SGLang's ``send_kvcache`` then only checks the chunk against what was copied and, at the last chunk,
queues the last part (the partial last page, the trailers, the end of ``lynx-exact``'s exact stream, whose
pieces each group's part queued too: ``prefill_stream``). A forward that computes the request's last token
and more than one SGLang page of it sends each group's partial last page and trailers with the group
(:meth:`LayerGroups._pages_to_queue` says when that is safe; ``stream_last_page``); its last part then only
closes the streams. The anchor and residual bytes are those of the whole-request encode
(``codec.stream_parts``' invariant), so the decode side sees nothing new.

Which requests: one whose chunk starts a forward before any of its KV was handed over or taken by
another path, when everything its first ``send_kvcache`` would check already holds (one Lynx decode
target, the same configuration, a token count that fits) and a send region is free now without
overtaking a request that waits for one or that a forward computed earlier (that one's ``send_kvcache``,
still to run, would wait for this request's region in the transfer worker, in front of this request's
own last chunk: a deadlock until ``transfer_timeout_s``, found by the back-pressure test). Its tokens
before the chunk (a radix-cached prefix such as a chat template, or earlier chunks whose
``send_kvcache`` has not run yet) are in the pool already: their rows of every layer are copied at once
and go with the first group's part. Any other request — and any request on a prefill whose KV pool is
not on the CPU (the copies would race the device's stream; ``attach_pool`` logs it) — is streamed per
chunk or buffered as before, and its ``send_kvcache`` decides everything as ever: this path only moves
work earlier; a refusal is still made (and recorded) by ``send_kvcache``.

Threads: the three calls run on the scheduler's thread, inside ``run_batch``; ``send_kvcache`` of an
earlier chunk of the same request may run on the transfer worker meanwhile (``busy`` counts both).
The worker never copies a layered request's rows, the hooks never queue its last part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.integration.transport.arena import KVShape, stream_sizes
from sglang_lynx.integration.transport.prefill_peers import sglang_tracks
from sglang_lynx.integration.transport.prefill_stream import StreamedRequest, StreamState
from sglang_lynx.integration.transport.prefill_streaming import StreamingChunks
from sglang_lynx.transfer.trace import trace

logger = logging.getLogger("sglang_lynx.transport")


@dataclass(frozen=True)
class ChunkInForward:
    """One request's chunk in a batch about to be computed: tokens ``[start, start + len(slots))``."""

    room: int
    start: int
    slots: torch.Tensor  # the KV-pool slot of each token of the chunk
    prefix_slots: torch.Tensor | None = None  # tokens [0, start): in the pool already (earlier chunks, radix cache)


def prune_unsent(unsent: dict[int, float], now: float, limit: float, tracked: Callable[[int], bool]) -> None:
    """Forget the rooms noted unsent (their chunk computed without layers, ``send_kvcache`` still to come)
    more than ``limit`` seconds ago that SGLang no longer tracks: theirs will never come (a failed room is
    forgotten at once, ``on_room_failed``). A room SGLang still tracks stays, however long its forward took:
    layered requests keep waiting behind it (FIFO)."""
    for room in [r for r, at in unsent.items() if now - at > limit and not tracked(r)]:
        del unsent[room]


@dataclass
class LayerForward:
    """A forward the layer hooks follow: its layered requests and the next layer not handed over yet."""

    manager: Any
    chunks: list[tuple[StreamedRequest, ChunkInForward]]
    next_layer: int = 0
    ended: bool = False


class LayerGroups(StreamingChunks):
    """The layer-group entry points of the prefill side (see the module docstring)."""

    def layer_group_ends(self) -> frozenset[int]:
        """The layer counts after which a group is handed over (the last layer always ends one)."""
        g, n = self.config.stream_layer_group, len(self.k_pool)
        return frozenset([*range(g, n, g), n]) if g > 0 else frozenset()

    def begin_forward(self, manager: Any, chunks: list[ChunkInForward]) -> LayerForward | None:
        """A batch's forward starts: the layered requests among ``chunks`` (None: none to follow)."""
        if self.config.stream_layer_group <= 0 or self._part_coder is None or not self.k_pool \
                or self.k_pool[0].device.type != "cpu":
            return None
        followed = []
        for chunk in chunks:  # in batch order: a request not layered holds back the ones after it
            streamed = self._layered_request(manager, chunk)
            if streamed is not None:
                followed.append((streamed, chunk))
            else:
                self._note_unsent(manager, chunk.room)
        if not followed:
            return None
        for streamed, chunk in followed:
            trace().emit("forward_begin", rid=streamed.request_id, start=chunk.start, tokens=len(chunk.slots))
        return LayerForward(manager, followed)

    def _note_unsent(self, manager: Any, room: int) -> None:
        """``room``'s chunk is computed without layers: until its send_kvcache takes its region, no layered
        request may take one (FIFO, as the transfer worker takes them). Rooms without a transfer target
        (SGLang's warm-up) never send: not noted."""
        if not getattr(manager, "transfer_infos", {}).get(room):
            return
        with self._lock:
            if room not in self._streamed:  # a streamed request already holds its region
                self._unsent[room] = time.monotonic()

    def _layered_request(self, manager: Any, chunk: ChunkInForward) -> StreamedRequest | None:
        room, prefix = chunk.room, chunk.prefix_slots
        # one hold of the lock from the check to the registration: the transfer worker may be in the room's
        # first send_kvcache right now (an earlier chunk), which must see either no request or a complete one
        with self._lock:
            streamed = self._streamed.get(room)
            if streamed is not None:  # a later chunk of a layered request continues where the last ended
                in_step = streamed.layered and streamed.copied == chunk.start
                if not in_step or streamed.state is not StreamState.RECEIVING:
                    return None
                streamed.enter()
                return streamed
            if room in self._pending or room in self._quieted:
                return None
            if chunk.start and (prefix is None or int(prefix.numel()) != chunk.start):
                return None  # its tokens before the chunk are not known: nothing to send them from
            started = self._start_layered(manager, room)
            if started is None:
                return None
            if chunk.start and prefix is not None:  # its cached prefix (or earlier chunks): every layer now
                started.add_layers(self.k_pool, self.v_pool, prefix, 0, range(len(self.k_pool)))
                started.chunk_copied(prefix, 0, chunk.start)
            self._streamed[room] = started
            self.requests_streamed += 1
            self.requests_layered += 1
            started.enter()
        return started

    def _start_layered(self, manager: Any, room: int) -> StreamedRequest | None:
        """Under the lock: a layered request for ``room`` with its send region, or None where its first
        ``send_kvcache`` must decide (anything to refuse, no free region now, another request waiting for
        one). The send arena's lock is only ever taken inside this one, never the other way round."""
        if self.test_faults.get(room) == "per_chunk":  # test hooks only: the per-chunk path on purpose
            return None
        infos = [i for i in list(getattr(manager, "transfer_infos", {}).get(room, {}).values())
                 if not getattr(i, "is_dummy", False)]
        if len(infos) != 1:
            return None
        registration = getattr(manager, "decode_kv_args_table", {}).get(getattr(infos[0], "mooncake_session_id", None))
        resolved = self._resolve_target(manager, infos[0], getattr(registration, "lynx", None))
        if isinstance(resolved, str):
            return None
        target, tokens, _pages, control = resolved
        heads, dim = int(self.k_pool[0].shape[1]), int(self.k_pool[0].shape[2])
        from sglang_lynx.codec.stream_parts import PartEncoder

        parts = PartEncoder(self._part_coder, len(self.k_pool), tokens, heads, dim)
        request_id = str(room)
        sizes = stream_sizes(self.codec, KVShape.of_pool(self.k_pool), tokens)
        prune_unsent(self._unsent, time.monotonic(), self.config.transfer_timeout_s,
                     lambda r: sglang_tracks(manager, r))
        if self._unsent or self.send_alloc.stats()["waiting"]:
            return None  # FIFO: requests computed earlier, or waiting for a region, go first
        try:
            lease = self.send_alloc.allocate(request_id, sizes)
        except Exception:  # full or too large now: the first send_kvcache waits or refuses, as ever
            return None
        streamed = StreamedRequest.start(request_id, parts, target, control, self.k_pool[0], len(self.k_pool))
        streamed.lease, streamed.layered = lease, True
        streamed.fault = self.test_faults.pop(room, None)
        self.page_reuse.forget(room)
        return streamed

    def layers_written(self, forward: LayerForward, end_layer: int) -> None:
        """Layers ``[forward.next_layer, end_layer)`` of every followed chunk are in the pool: copy and
        queue them."""
        if end_layer <= forward.next_layer or forward.ended:
            return
        layers, forward.next_layer = range(forward.next_layer, end_layer), end_layer
        for streamed, chunk in forward.chunks:
            if streamed.state is not StreamState.RECEIVING:
                continue
            end = streamed.add_layers(self.k_pool, self.v_pool, chunk.slots, chunk.start, layers)
            full = self._pages_to_queue(streamed, chunk, end)
            if full > streamed.queued_pages:
                self._queue_group(forward.manager, chunk.room, streamed, full, layers)
                trace().emit("layers_queued", rid=streamed.request_id, layers=end_layer, pages=full)
            if end_layer == len(self.k_pool):
                streamed.chunk_copied(chunk.slots, chunk.start, end)
                streamed.queued_pages = max(streamed.queued_pages, full)

    def _pages_to_queue(self, streamed: StreamedRequest, chunk: ChunkInForward, end: int) -> int:
        """The codec pages of the group's layers to queue once the forward wrote tokens up to ``end``.

        The page of the request's last token waits for the last part, since SGLang may hand tokens over
        from other KV slots than the forward wrote (``StreamedRequest.take_copied_chunk``): after the
        forward it inserts the chunk into its radix cache and maps the tokens the cache already held to the
        cached copies. The cache can hold this chunk's tokens at scheduling time only when it held the
        whole prompt and SGLang capped the match to leave the last token (page size 1) or the last page
        (``--page-size P``: at most P tokens) to compute. So a forward that computes the last token and more
        than ``page_size`` tokens of the request takes its layers to the end (the partial last page and the
        trailers, ``PartEncoder.encode_part``): the last part, after the forward, then has nothing of them
        left to send (at 1.4K tokens ~10% of the anchor). What is left is the case every sent page has: a
        request with the same prompt inserted between this one's scheduling and its insert, whose copies
        ``take_copied_chunk`` compares byte for byte."""
        if self.config.stream_last_page and end >= streamed.tokens \
                and streamed.tokens - chunk.start > max(1, self.page_size):
            return streamed.parts.pages
        return min(end, streamed.tokens - 1) // streamed.parts.page

    def _queue_group(self, manager: Any, room: int, streamed: StreamedRequest, full: int, layers: range) -> None:
        encode = self._part_encode(streamed, full, False, layers)
        if streamed.transfer is None:
            self._stream_submit(manager, room, streamed, encode, False)
        elif not self.scheduler.extend(streamed.transfer, encode):  # failed meanwhile: the decode was told
            with self._lock:
                self._over(streamed, "its transfer is over")

    def end_forward(self, forward: LayerForward, completed: bool = True) -> None:
        """The forward is over (``completed``: it returned): layers no hook handed over (a model that skips
        a layer's write) are taken now, then the requests are released (an over one is cleaned up by
        whoever holds it last). After a forward that raised nothing more is queued: the chunk was not
        copied, so its ``send_kvcache`` refuses it."""
        try:
            if completed and forward.next_layer < len(self.k_pool):
                self.layers_written(forward, len(self.k_pool))
        finally:
            forward.ended = True
            for streamed, _chunk in forward.chunks:
                trace().emit("forward_end", rid=streamed.request_id, completed=completed)
                self._release(streamed)
