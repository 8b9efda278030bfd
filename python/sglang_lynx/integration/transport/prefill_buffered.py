"""The buffered path of the prefill side: a request's chunks are copied out of the pool until the last
one, then the whole request is encoded and submitted (``prefill_side`` tells the lifecycle; a request
is buffered when it comes in one chunk, or when its KV has no page-range encoder).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sglang_lynx.codec.wire_residual import residual_to_wire
from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.integration.transport.arena import KVShape, stream_sizes
from sglang_lynx.integration.transport.codec import encode_exact_stream, encode_request_streams
from sglang_lynx.integration.transport.prefill_base import Pending, PrefillSideBase
from sglang_lynx.integration.transport.prefill_peers import refuse
from sglang_lynx.integration.transport.wire import dump_kv
from sglang_lynx.transfer.progress import EncodedObject, ExactPart, LocalBuffer
from sglang_lynx.transfer.staging import StagingTooLargeError
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind


class BufferedChunks(PrefillSideBase):
    """Chunks copied until the last, then one whole-request encode and submit."""

    def _buffer_chunk(self, room: int, total_pages: int, tokens: int, target: RemoteTarget, control: str,
                      indices: torch.Tensor, pages: int) -> Pending | None:
        """Under the lock: copy a chunk of a buffered request; its ``Pending`` once the last one came."""
        pending = self._pending.get(room)
        if pending is None:
            pending = Pending(total_pages, tokens, target, control)
            self._pending[room] = pending
        pending.active = time.monotonic()
        pending.k_parts.append([layer[indices].clone() for layer in self.k_pool])
        pending.v_parts.append([layer[indices].clone() for layer in self.v_pool])
        pending.slots.append(indices)
        pending.pages += pages
        if pending.pages < pending.total_pages:
            return None
        del self._pending[room]
        self._submitting.add(room)
        return pending

    def _submit(self, manager: Any, room: int, pending: Pending) -> int:
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
            return refuse(manager, room, f"send arena {what}: {exc}")

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

            def encode_exact() -> ExactPart:  # on the scheduler's exact thread, while the others are sent
                n = encode_exact_stream(k_layers, v_layers, anchor, residual, self.codec,
                                        region_view(StreamKind.EXACT), self.config)
                return ExactPart.whole(LocalBuffer(lease.regions[StreamKind.EXACT].addr, n))

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
            return refuse(manager, room, f"the Lynx transfer scheduler refused the request: {exc}")
        transfer.quiet.add_done_callback(lambda _f: self._on_quiet(request_id))
        return 0
