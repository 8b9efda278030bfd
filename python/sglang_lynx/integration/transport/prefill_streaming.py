"""The streamed path of the prefill side: a request of several chunks is encoded and sent part by part
while its prefill runs (``LynxConfig.stream_prefill``; ``prefill_stream`` has the request's states,
``codec.stream_parts`` the bytes of each part; ``prefill_side`` tells the lifecycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport.arena import KVShape, stream_sizes
from sglang_lynx.integration.transport.codec import exact_stream_writer
from sglang_lynx.integration.transport.pages import pages_for
from sglang_lynx.integration.transport.prefill_base import PrefillSideBase
from sglang_lynx.integration.transport.prefill_peers import refuse
from sglang_lynx.integration.transport.prefill_stream import StreamedRequest, StreamState
from sglang_lynx.integration.transport.wire import dump_kv
from sglang_lynx.transfer.progress import ExactPart, LocalBuffer
from sglang_lynx.transfer.staging import StagingTooLargeError
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind


class StreamingChunks(PrefillSideBase):
    """Each chunk's complete codec pages encoded and queued as the chunk arrives."""

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
        try:
            return self._stream_step(manager, room, streamed, slots, pages)
        finally:
            self._release(streamed)

    def _release(self, streamed: StreamedRequest) -> None:
        """A thread is done with ``streamed`` (``busy``); the last one out cleans up an over request."""
        cleanup = None
        with self._lock:
            streamed.leave()
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
            return refuse(manager, room, f"sent {streamed.pages_seen} pages, decode allocated {allocated}")
        if streamed.state is StreamState.OVER:  # refused or failed at an earlier chunk: encode nothing
            if streamed.skip_chunk(slots):
                with self._lock:
                    if self._streamed.get(room) is streamed:
                        del self._streamed[room]
            return -1 if streamed.refused else 0
        if streamed.layered:  # the forward's layer hooks copied and queued its full pages
            problem = streamed.take_copied_chunk(slots, self.k_pool, self.v_pool)
            if problem:
                with self._lock:
                    streamed.refused = True
                    self._over(streamed, problem)
                return refuse(manager, room, problem)
            last = streamed.received >= streamed.tokens
            if not last:  # its full pages are queued by the layer hooks, never here
                return 0
        else:
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
                return refuse(manager, room, f"send arena {what}: {exc}")
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

    def _part_encode(self, streamed: StreamedRequest, end_page: int, last: bool, layers: range | None = None) -> Any:
        lease, request_id, first = streamed.lease, streamed.request_id, streamed.transfer is None
        fault = streamed.fault

        def region(kind: StreamKind) -> torch.Tensor:
            r = lease.regions[kind]
            return self.arena[r.addr - self.arena.data_ptr():][: r.capacity]

        def exact_part(runs: list[tuple[int, int, int]], last: bool) -> Callable[[], ExactPart]:
            def encode_exact() -> ExactPart:  # on the scheduler's exact thread, parts in order
                out = region(StreamKind.EXACT)
                if streamed.exact_writer is None:
                    heads, dim = streamed.parts.heads, streamed.parts.dim
                    streamed.exact_writer = exact_stream_writer(self.codec, len(streamed.k_layers), streamed.tokens,
                                                                heads, dim, out, self.config)
                writer = streamed.exact_writer
                anchor = region(StreamKind.ANCHOR)[: streamed.parts.anchor_bytes]
                at, n = writer.write(streamed.k_layers, streamed.v_layers, anchor, streamed.scratch, runs, last)
                return ExactPart(LocalBuffer(out.data_ptr(), writer.length), ((at, n),) if n else ())

            return encode_exact

        exact = exact_part if StreamKind.EXACT in lease.regions else None
        on_start = (lambda: transport_faults.on_encode_start(fault, request_id)) if first else None
        return streamed.part_encode(end_page, last, region, exact, on_start, layers)

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
            return refuse(manager, room, f"the Lynx transfer scheduler refused the request: {exc}")
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
