"""One inbound request on the decode side: where its KV goes, and what of it has landed.

Created by ``LynxDecodeSide.expect`` (``transport.decode_side``) and read by the decode hooks (the
speculative decoder): anchor landed, residual landed (in ``lynx-exact``: residual AND exact stream, so
the upgrade restores the BF16 KV bit for bit), failure, and the two pool writes (anchor-only, then the
full upgrade). ``reserved`` turns True once the request's staging region is reserved (it
may wait for one in the receive arena's FIFO queue before that; the streams land only after).

The full upgrade off the scheduler thread (``lynx-exact``): while a request streamed in parts lands,
the decode side's worker thread restores its BF16 KV piece by piece into the request's own tensors
(``on_progress``, ``exact_prefetch``); when its last stream lands, the worker (``prepare_full``) restores
what is left (all of it when nothing was restored ahead) while the scheduler admits it or keeps drafting;
``full_kv_ready`` holds the verify back until that is done, and ``upgrade_kv`` then copies it into the
pool slots (the same bytes the in-place decode writes; a preparation that failed, or none, decodes in
place as before). The worker writes only its own tensors, never the pool, so a request aborted
meanwhile cannot have its freed slots overwritten.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_lynx.codec.wire_residual import residual_from_wire
from sglang_lynx.integration.transport.codec import decode_exact_streams, decode_request_streams
from sglang_lynx.integration.transport.exact_prefetch import ExactPrefetch, PrefetchBudget
from sglang_lynx.integration.transport.wire import dump_kv
from sglang_lynx.transfer.receiver import InboundRequest, InboundState
from sglang_lynx.transfer.streams import StreamKind, view_at

logger = logging.getLogger("sglang_lynx.transport")


@dataclass
class InboundProgress:
    """One request's inbound streams and where its KV goes in the pool."""

    room: int
    slots: torch.Tensor  # int64 pool slot of each token
    side: Any  # the LynxDecodeSide it belongs to
    anchor_decoded: bool = False
    residual_decoded: bool = False  # lynx-exact's middle stage: the 8-bit KV in the pool, exact not yet
    full_decoded: bool = False
    created: float = field(default_factory=time.monotonic)
    armed_at: float | None = None  # when the prefill finished (SGLang success): the transfer clock starts
    accepted: bool = False  # a Lynx prefill said it took the request (``accepted`` notice)
    source: str | None = None  # the prefill's bootstrap address (its heartbeat loss fails the request)
    sizes: dict[StreamKind, int] = field(default_factory=dict)
    reserved: bool = False  # its staging region is reserved (until then it waits in the FIFO queue)
    prepared: Future | None = None  # the full KV decoded by the decode side's worker (prepare_full)
    prefetch: ExactPrefetch | None = None  # lynx-exact: the BF16 KV restored while the streams land
    step_queued: bool = False  # a prefetch step is queued on the worker (one at a time is enough)
    full_ready_at: float | None = None  # when the worker had the full KV restored (lynx-exact)
    # (token rows of layer K / V restored before the last landing, all of them: 2 x layers x tokens)
    exact_restored: tuple[int, int] | None = None

    @property
    def request(self) -> InboundRequest | None:
        return self.side.tracker.get(str(self.room))

    def anchor_landed(self) -> bool:
        req = self.request
        return req is not None and req.anchor_landed

    def residual_landed(self) -> bool:
        req = self.request
        return req is not None and req.complete

    def anchor_awaited(self) -> bool:
        """The anchor has not landed, has not failed, and its deadline has not passed (a later stream may
        have failed meanwhile)."""
        req = self.request
        return (req is not None and req.states.get(StreamKind.ANCHOR) is InboundState.EXPECTED
                and time.monotonic() <= req.deadline)

    def failure(self) -> str | None:
        req = self.request
        if req is None:
            return "no Lynx transfer is tracked for this request"
        if req.failed:
            return req.error or "failed"
        return None

    def _stream_bytes(self, kind: StreamKind) -> torch.Tensor:
        req = self.request
        assert req is not None
        region = req.lease.regions[kind]
        length = req.landed_bytes.get(kind, req.sizes[kind])  # the exact stream: what the sender wrote
        return torch.frombuffer(view_at(region.addr, length), dtype=torch.uint8)

    def _whole_residual(self, anchor: torch.Tensor) -> torch.Tensor:
        """The request's whole residual stream: the landed body plus the tails its anchor carries."""
        k_pool = self.side.k_pool
        return residual_from_wire(anchor, self._stream_bytes(StreamKind.RESIDUAL), self.side.codec, len(k_pool),
                                  int(self.slots.numel()), int(k_pool[0].shape[1]), int(k_pool[0].shape[2]))

    def _decode(self, with_residual: bool, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
                slots: torch.Tensor) -> None:
        """Dequantize the landed streams into ``k_layers[l][slots]`` / ``v_layers[l][slots]``."""
        anchor = self._stream_bytes(StreamKind.ANCHOR)
        residual = self._whole_residual(anchor) if with_residual and self.side.two_streams else None
        req = self.request
        if residual is not None and req is not None and StreamKind.EXACT in req.sizes:
            decode_exact_streams(anchor, residual, self._stream_bytes(StreamKind.EXACT), k_layers, v_layers, slots,
                                 self.side.codec, self.side.config)
        else:
            decode_request_streams(anchor, residual, k_layers, v_layers, slots, self.side.codec, self.side.config)

    def _dump(self, stage: str) -> None:
        """Debug dump of the request's pool slots. Lazy: nothing is gathered unless dumping is on (a list here
        copied every layer's KV of the request on every decode, ~30 MB at 1.4K tokens)."""
        dump_kv(f"decode-{self.side.tp.dump_tag}{self.room}-{stage}", (layer[self.slots] for layer in self.side.k_pool),
                (layer[self.slots] for layer in self.side.v_pool))

    def decode_into_pool(self, with_residual: bool) -> None:
        self._decode(with_residual, self.side.k_pool, self.side.v_pool, self.slots)
        self._dump("full" if with_residual else "anchor")
        if with_residual:
            self.full_decoded = True
        else:
            self.anchor_decoded = True

    def upgrade_to_residual(self) -> bool:
        """``lynx-exact``'s middle stage: once the residual landed (the exact stream not yet) after an
        anchor-only decode, overwrite the slots with the 8-bit reconstruction so that the drafts made
        from now on come from it (they are drafts all the same: the verify runs on the exact KV).
        True when it upgraded now; a no-op in the other modes and at any other time."""
        req = self.request
        if (req is None or StreamKind.EXACT not in req.sizes or not self.anchor_decoded or self.residual_decoded
                or self.full_decoded or req.failed or req.states.get(StreamKind.RESIDUAL) is not InboundState.LANDED
                or req.states.get(StreamKind.EXACT) is InboundState.LANDED):
            return False
        anchor = self._stream_bytes(StreamKind.ANCHOR)
        decode_request_streams(anchor, self._whole_residual(anchor), self.side.k_pool, self.side.v_pool, self.slots,
                               self.side.codec, self.side.config)
        self.residual_decoded = True
        return True

    # ----- the full upgrade, prepared off the scheduler thread (module docstring) -----
    def on_progress(self, executor: Executor, budget: PrefetchBudget) -> bool:
        """A part of the request is in place (control thread): queue a step restoring what it can, once a
        prefetch exists (created here when ``budget`` has room). True when a step was queued."""
        req = self.request
        if req is None or req.failed or StreamKind.EXACT not in req.sizes or self.prepared is not None:
            return False
        if self.prefetch is None:
            self.prefetch = ExactPrefetch.within(self, budget)
            if self.prefetch is None:
                return False
        if self.step_queued:
            return False
        self.step_queued = True
        executor.submit(self._step, self.prefetch)
        return True

    def _step(self, prefetch: ExactPrefetch) -> None:
        self.step_queued = False  # before the step: a notice meanwhile queues the next
        prefetch.step()

    def prepare_full(self, executor: Executor) -> bool:
        """Start restoring the full KV on ``executor`` (the control thread calls this when the last stream
        landed). Only for a ``lynx-exact`` request not yet upgraded, once: one restored ahead
        (``on_progress``) finishes whether or not it was admitted yet; one that was not is prepared only
        when it is already drafting (else its admission decodes it in place, as before). ``lynx``'s 8-bit
        decode (12-45 ms here) stays inline: on the worker, sharing the GIL with the scheduler's forward,
        it took longer than inline (a bf16 test saw its verify come 3 drafts later); the exact stream's
        decode (0.24 s at 1.4K tokens, ~0.5 s at 5.6K on the one-pass C path of 294b505) is the long one."""
        req = self.request
        if (self.prepared is not None or self.full_decoded or req is None or StreamKind.EXACT not in req.sizes
                or (self.prefetch is None and not self.anchor_decoded)):
            return False
        prefetch = self.prefetch or ExactPrefetch(self)
        self.prepared = executor.submit(prefetch.finish)
        return True

    def full_kv_ready(self) -> bool:
        """Every stream landed and, when the upgrade is being prepared, the preparation is done (the
        verify waits for it, drafting on meanwhile, rather than decoding inline)."""
        return self.residual_landed() and (self.prepared is None or self.prepared.done())

    def upgrade_kv(self) -> None:
        """The residual landed after an anchor-only decode: overwrite the slots with the full KV (the
        prepared tensors when their preparation succeeded, else decoded in place now)."""
        if self.prepared is not None:
            try:
                k_layers, v_layers = self.prepared.result()
            except Exception as exc:  # decoded in place below: the same error, raised where it is handled
                logger.warning("lynx: request %s: the prepared upgrade failed (%s); decoding in place", self.room, exc)
            else:
                for pool, layer in zip((*self.side.k_pool, *self.side.v_pool), (*k_layers, *v_layers), strict=True):
                    pool.index_copy_(0, self.slots.to(pool.device), layer)
                self.prepared = None
                self.release()
                self._dump("full")
                self.full_decoded = True
                return
            self.prepared = None
        self.release()
        self.decode_into_pool(with_residual=True)

    def release(self) -> None:
        """Drop the KV restored ahead (its budget back); idempotent, any thread."""
        prefetch = self.prefetch
        if prefetch is not None:
            prefetch.release()
