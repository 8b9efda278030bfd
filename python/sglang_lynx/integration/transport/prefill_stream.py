"""One request streamed while its prefill runs: its chunks' pages are encoded and sent as they arrive.

SGLang's transfer worker hands a chunked prefill's KV over chunk by chunk (``send_kvcache`` per chunk,
``prefill_side``). A request whose first chunk does not hold all its pages is **streamed** when the
server's codec has a page-range encoder on the KV's device (the C fast path or the torch reference on
the CPU; a CUDA server keeps the whole-request Triton encode): at its first chunk it takes its send
region (as a whole request would: sizes follow from its token count) and its transfer is submitted
with the first part; each later chunk's complete codec pages become the next part
(``TransferScheduler.extend``), and the last chunk's part completes the streams (the partial last
page, the trailers, the checksums, the end of ``lynx-exact``'s exact stream). Parts go through the
scheduler's priority rules like any chunk: a later part's anchor before an earlier part's residual. In
``lynx-exact`` each part also has an exact encode, run by the scheduler's exact thread once the part's
anchor and residual are queued: the exact stream of the pages the part completed (``codec.exact_request``),
sent below every anchor and residual byte. The decode side sees nothing new: the same bytes land in the
same places (``codec.stream_parts``), then one ``landed`` notice per stream as before, so it admits on the
anchor once the last chunk's part landed.

States of a :class:`StreamedRequest` (owned by :class:`~.prefill_side.LynxPrefillSide`, one per room)::

    RECEIVING --(last chunk queued)--> SUBMITTED (the prefill side forgets it)
        \\--(submit refused / transfer over / stale / room failed)--> OVER

Threads: ``add_chunk`` and the submission run on SGLang's transfer worker; the encode closures on the
scheduler's encode thread, one part after another. The worker writes rows of the whole-request KV
copies that no queued part reads (each part reads only pages complete before it was queued).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.transfer.progress import EncodedObject, ExactPart, LocalBuffer, RequestTransfer
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind

#: Makes a part's exact encode (``lynx-exact``) from the page runs it encoded (``PartEncoder.runs``) and ``last``.
ExactPartFactory = Callable[[list[tuple[int, int, int]], bool], Callable[[], ExactPart]]


class StreamState(enum.Enum):
    RECEIVING = "receiving"  # chunks still to come
    SUBMITTED = "submitted"  # the last part is queued: the scheduler owns the rest
    OVER = "over"  # refused or failed: later chunks are not encoded (nothing writes into its region)


@dataclass
class StreamedRequest:
    """The whole-request KV copies and the part encoder of one streamed request."""

    request_id: str
    parts: PartEncoder
    target: RemoteTarget
    control: str
    k_layers: list[torch.Tensor]  # [T, H, D] each, rows filled as chunks arrive
    v_layers: list[torch.Tensor]
    scratch: torch.Tensor  # the residual as computed, whole request (``PartEncoder.new_scratch``)
    active: float = field(default_factory=time.monotonic)  # when a thread last took or left one of its chunks
    state: StreamState = StreamState.RECEIVING
    received: int = 0  # tokens copied so far
    queued_pages: int = 0  # codec pages handed to parts so far
    pages_seen: int = 0  # SGLang pages of the chunks so far
    lease: Any = None  # its send-region lease, once taken
    transfer: RequestTransfer | None = None
    fault: str | None = None  # test only (SGLANG_LYNX_TEST_HOOKS=1)
    why_over: str = ""
    refused: bool = False  # over because this side refused it (its later chunks are refused too)
    busy: int = 0  # threads in one of its chunks (a transfer worker, the forward's layer hooks): they clean up
    cleaned: bool = False  # its region was freed or its transfer aborted (once)
    # layer groups (``prefill_layers``): its chunks were copied and queued by the forward's layer hooks
    layered: bool = False
    copied: int = 0  # tokens the layer hooks copied (every layer)
    copied_slots: torch.Tensor | None = None  # their pool slots, to check the chunks SGLang hands over
    # lynx-exact: its exact stream's writer, made and used by the scheduler's exact thread only (parts in order)
    exact_writer: Any = None

    @classmethod
    def start(cls, request_id: str, parts: PartEncoder, target: RemoteTarget, control: str,
              like: torch.Tensor, layers: int) -> StreamedRequest:
        shape = (parts.tokens, parts.heads, parts.dim)
        make = lambda: [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]  # noqa: E731
        return cls(request_id, parts, target, control, make(), make(), parts.new_scratch(like.device))

    @property
    def tokens(self) -> int:
        return self.parts.tokens

    def enter(self) -> None:
        """A thread takes one of its chunks (under the prefill side's lock): ``busy`` and the stale clock."""
        self.busy, self.active = self.busy + 1, time.monotonic()

    def leave(self) -> None:
        """That thread is done with the chunk (under the prefill side's lock)."""
        self.busy, self.active = self.busy - 1, time.monotonic()

    def add_chunk(self, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], slots: torch.Tensor) -> bool:
        """Copy a chunk's token slots (in prompt order, after the tokens received so far) out of the
        pool; True when this was the last chunk (every token received)."""
        n = min(int(slots.numel()), self.tokens - self.received)
        at, slots = self.received, slots[:n]
        for pool, rows in ((k_pool, self.k_layers), (v_pool, self.v_layers)):
            for layer, x in zip(pool, rows, strict=True):
                rows_view = x[at : at + n]
                rows_view.copy_(layer[slots.to(layer.device)])
        self.received += n
        return self.received >= self.tokens

    def add_layers(self, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], slots: torch.Tensor, at: int,
                   layers: range) -> int:
        """Copy the rows of ``layers`` of a chunk the forward is computing (tokens ``[at, at + n)`` in
        ``slots``); returns the end token. The last group's call records the slots."""
        n = min(int(slots.numel()), self.tokens - at)
        for pool, rows in ((k_pool, self.k_layers), (v_pool, self.v_layers)):
            for i in layers:
                rows[i][at : at + n].copy_(pool[i][slots[:n].to(pool[i].device)])
        return at + n

    def chunk_copied(self, slots: torch.Tensor, at: int, end: int) -> None:
        """Every layer of the chunk ``[at, end)`` (slots ``slots``) is copied: the chunk is the layer hooks'."""
        if self.copied_slots is None:
            self.copied_slots = torch.full((self.tokens,), -1, dtype=torch.int64)
        self.copied_slots[at:end] = slots[: end - at].to("cpu", torch.int64)
        self.copied = end

    def take_copied_chunk(self, slots: torch.Tensor, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> str:
        """SGLang hands over a chunk the layer hooks copied: count it (as ``add_chunk``), or say why it cannot
        be (then its KV must not be sent).

        The slots may differ from the ones the forward wrote: after the forward SGLang inserts the chunk into
        its radix cache, and tokens the cache already held (a prompt seen before: only its last token is
        recomputed) are mapped to the cached slots, whose KV SGLang sends. Rows of tokens no part has read
        yet (the hooks never queue the page of the request's last token) are copied again from the slots
        handed over; rows already sent must hold the same bytes there."""
        n = min(int(slots.numel()), self.tokens - self.received)
        at = self.received
        if at + n > self.copied or self.copied_slots is None:
            return f"tokens [{at}, {at + n}) were handed over but the forward's layer hooks copied {self.copied}"
        handed = slots[:n].to("cpu", torch.int64)
        moved = torch.nonzero(self.copied_slots[at : at + n] != handed).flatten()
        if moved.numel():
            tokens, where = at + moved, handed[moved]
            sent = tokens < self.queued_pages * self.parts.page
            for pool, rows in ((k_pool, self.k_layers), (v_pool, self.v_layers)):
                for layer, x in zip(pool, rows, strict=True):
                    cached = layer[where.to(layer.device)]
                    if not torch.equal(x[tokens[sent]].view(torch.uint8), cached[sent].view(torch.uint8)):
                        return (f"tokens [{at}, {at + n}) were handed over from other KV slots than the forward "
                                f"wrote, with other KV in rows already sent (radix-cached copies of "
                                f"{int(sent.sum())} token(s))")
                    x[tokens[~sent]] = cached[~sent]
            self.copied_slots[tokens] = where
        self.received += n
        return ""

    def skip_chunk(self, slots: torch.Tensor) -> bool:
        """Count a chunk of an over request without copying it; True when it was the last."""
        self.received = min(self.tokens, self.received + int(slots.numel()))
        return self.received >= self.tokens

    def next_part(self) -> tuple[int, bool] | None:
        """(end page, last) of the part the chunks so far complete, or None when no new page is complete."""
        last = self.received >= self.tokens
        end = self.parts.encodable_pages(self.received)
        if not last and end <= self.queued_pages:
            return None
        self.queued_pages = end
        return end, last

    def part_encode(self, end_page: int, last: bool, region: Callable[[StreamKind], torch.Tensor],
                    exact: ExactPartFactory | None,
                    on_start: Callable[[], None] | None = None,
                    layers: range | None = None) -> Callable[[], EncodedObject]:
        """The encode closure of one part (runs on the scheduler's encode thread); ``layers``: a layer
        group's part (None: every layer); ``exact`` (``lynx-exact``): makes the part's exact encode from
        the page runs the part encoded."""
        parts, has_body, scratch = self.parts, self.parts.body_bytes > 0, self.scratch

        def encode() -> EncodedObject:
            if on_start is not None:
                on_start()
            anchor = region(StreamKind.ANCHOR)[: parts.anchor_bytes]
            body = region(StreamKind.RESIDUAL)[: parts.body_bytes] if has_body else None
            runs = parts.runs(end_page, last, layers) if exact is not None else []
            a_spans, b_spans = parts.encode_part(self.k_layers, self.v_layers, end_page, last, anchor, scratch, body,
                                                 layers)
            spans = {StreamKind.ANCHOR: tuple(a_spans)}
            residual = None
            if body is not None:
                spans[StreamKind.RESIDUAL] = tuple(b_spans)
                residual = LocalBuffer(body.data_ptr(), parts.body_bytes)
            return EncodedObject(LocalBuffer(anchor.data_ptr(), parts.anchor_bytes), residual,
                                 exact(runs, last) if exact is not None else None, spans, final=last)

        return encode
