"""``lynx-exact`` on the decode side: a request's BF16 KV restored while its streams land.

A request streamed during its prefill arrives part by part; the sender reports each part's bytes once they
are in place (``progress`` notices, ``transfer/control.py``), and the exact pieces of a part need only that
part's anchor and residual blocks (``codec.exact_request_reader``). So most of a long request's exact KV
can be restored while its prefill still runs, and what is left when the last stream lands is the last
part's pieces: the verify (or the admission without drafts) no longer waits for the whole stream's decode.

Lifecycle (one :class:`ExactPrefetch` per request, owned by its ``InboundProgress``; ``step`` and
``finish`` run on the decode side's single worker thread, in the order they were submitted):

1. created at the request's first progress notice when the side's :class:`PrefetchBudget`
   (``LynxConfig.exact_prefetch_mb``) has room for its private tensors (K and V of every layer,
   ``[tokens, heads, dim]`` bf16 on the pool's device: 16 bits per value, as many bytes as the request's
   pool slots); otherwise none, and the whole exact stream is restored once it landed, as before;
2. ``step()`` after each progress notice restores the pieces whose bytes are in place;
3. ``finish()`` once every stream landed (checksums verified) restores the rest against the whole anchor
   and residual and returns the tensors; ``upgrade_kv`` copies them into the pool slots;
4. ``release()`` (any thread, idempotent): the budget back, the tensors dropped.

Bytes read before their stream landed are not crc-checked yet: nothing computed from them reaches the
pool unless the request completed (every stream landed and verified), and a request that failed is
forgotten with its tensors. A step that raises (bytes that do not parse: a corrupt stream, whose landing
will fail) leaves the object broken, and ``finish`` then restores everything from the landed streams.
The worker writes only these private tensors, never the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from sglang_lynx.codec.exact_request_reader import ExactRequestReader
from sglang_lynx.codec.wire_residual import residual_tail_bytes
from sglang_lynx.integration.transport.codec import exact_layer_codec, exact_piece_runner
from sglang_lynx.transfer.streams import StreamKind, view_at

logger = logging.getLogger("sglang_lynx.transport")


class PrefetchBudget:
    """Bytes of private KV the decode side may hold for requests restored ahead (thread-safe)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit, self.held, self._lock = int(limit_bytes), 0, threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held = max(0, self.held - nbytes)


class ExactPrefetch:
    """One request's exact KV, restored piece by piece (module docstring)."""

    def __init__(self, progress: Any, budget: PrefetchBudget | None = None) -> None:
        side = progress.side
        self.progress, self.budget = progress, budget
        tokens, layers = int(progress.slots.numel()), len(side.k_pool)
        heads, dim = int(side.k_pool[0].shape[1]), int(side.k_pool[0].shape[2])
        self.reader = ExactRequestReader(side.codec, layers, tokens, heads, dim,
                                         residual_tail_bytes(side.codec, tokens, heads, dim), exact_layer_codec(),
                                         exact_piece_runner(side.config))
        self.nbytes = sum(tokens * layer[0].numel() * layer.element_size() for layer in (*side.k_pool, *side.v_pool))
        self.k_layers: list[torch.Tensor] | None = None
        self.v_layers: list[torch.Tensor] | None = None
        self.broken: str | None = None
        self.released = False

    @classmethod
    def within(cls, progress: Any, budget: PrefetchBudget) -> ExactPrefetch | None:
        """A prefetch whose tensors ``budget`` has room for, else None."""
        prefetch = cls(progress)
        if not budget.take(prefetch.nbytes):
            return None
        prefetch.budget = budget
        return prefetch

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.k_layers is None or self.v_layers is None:
            side, tokens = self.progress.side, int(self.progress.slots.numel())
            self.k_layers, self.v_layers = ([torch.empty((tokens, *layer.shape[1:]), dtype=layer.dtype,
                                                         device=layer.device) for layer in pool]
                                            for pool in (side.k_pool, side.v_pool))  # fmt: skip
        return self.k_layers, self.v_layers

    def step(self) -> int:
        """Restore the pieces whose bytes are in place now; how many (0 when there is nothing to do)."""
        req = self.progress.request
        if self.released or self.broken is not None or req is None or req.failed:
            return 0
        try:
            k_out, v_out = self._tensors()
            streams = {kind: view_at(req.lease.regions[kind].addr, req.sizes[kind])
                       for kind in (StreamKind.ANCHOR, StreamKind.RESIDUAL, StreamKind.EXACT)}
            return self.reader.take(
                streams[StreamKind.EXACT], req.prefix_in_place(StreamKind.EXACT),
                torch.frombuffer(streams[StreamKind.ANCHOR], dtype=torch.uint8),
                lambda a, b: req.covered(StreamKind.ANCHOR, a, b),
                torch.frombuffer(streams[StreamKind.RESIDUAL], dtype=torch.uint8),
                lambda a, b: req.covered(StreamKind.RESIDUAL, a, b), k_out, v_out)
        except Exception as exc:  # finish() starts over from the landed streams
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.warning("lynx: request %s: restoring the exact KV ahead stopped (%s); it is restored once "
                           "landed", self.progress.room, self.broken)
            return 0

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every stream landed: the request's whole BF16 KV (raises when the streams do not decode)."""
        progress = self.progress
        if self.broken is not None:
            fresh = ExactPrefetch(progress)
            fresh.k_layers, fresh.v_layers = self.k_layers, self.v_layers
            return fresh.finish()
        ahead = self.reader.restored_rows
        anchor = progress._stream_bytes(StreamKind.ANCHOR)
        k_out, v_out = self._tensors()
        exact = progress._stream_bytes(StreamKind.EXACT).numpy()
        self.reader.finish(memoryview(exact), anchor, progress._whole_residual(anchor), k_out, v_out)
        progress.exact_restored, progress.full_ready_at = (ahead, self.reader.restored_rows), time.monotonic()
        return k_out, v_out

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.k_layers = self.v_layers = None
            if self.budget is not None:
                self.budget.give(self.nbytes)
