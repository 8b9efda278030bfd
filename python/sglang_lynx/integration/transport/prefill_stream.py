"""One request streamed while its prefill runs: its chunks' pages are encoded and sent as they arrive.

SGLang's transfer worker hands a chunked prefill's KV over chunk by chunk (``send_kvcache`` per chunk,
``prefill_side``). A request whose first chunk does not hold all its pages is **streamed** when the
server's codec has a page-range encoder on the KV's device (the C fast path or the torch reference on
the CPU; a CUDA server keeps the whole-request Triton encode): at its first chunk it takes its send
region (as a whole request would: sizes follow from its token count) and its transfer is submitted
with the first part; each later chunk's complete codec pages become the next part
(``TransferScheduler.extend``), and the last chunk's part completes the streams (the partial last
page, the trailers, the checksums, ``lynx-exact``'s exact stream). Parts go through the scheduler's
priority rules like any chunk: a later part's anchor before an earlier part's residual. The decode
side sees nothing new: the same bytes land in the same places (``codec.stream_parts``), then one
``landed`` notice per stream as before, so it admits on the anchor once the last chunk's part landed.

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
from sglang_lynx.transfer.progress import EncodedObject, LocalBuffer, RequestTransfer
from sglang_lynx.transfer.streams import RemoteTarget, StreamKind


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
    started: float = field(default_factory=time.monotonic)
    state: StreamState = StreamState.RECEIVING
    received: int = 0  # tokens copied so far
    queued_pages: int = 0  # codec pages handed to parts so far
    pages_seen: int = 0  # SGLang pages of the chunks so far
    lease: Any = None  # its send-region lease, once taken
    transfer: RequestTransfer | None = None
    fault: str | None = None  # test only (SGLANG_LYNX_TEST_HOOKS=1)
    why_over: str = ""
    refused: bool = False  # over because this side refused it (its later chunks are refused too)
    busy: bool = False  # a transfer worker is in one of its chunks (then only it cleans up)
    cleaned: bool = False  # its region was freed or its transfer aborted (once)

    @classmethod
    def start(cls, request_id: str, parts: PartEncoder, target: RemoteTarget, control: str,
              like: torch.Tensor, layers: int) -> StreamedRequest:
        shape = (parts.tokens, parts.heads, parts.dim)
        make = lambda: [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(layers)]  # noqa: E731
        return cls(request_id, parts, target, control, make(), make(), parts.new_scratch(like.device))

    @property
    def tokens(self) -> int:
        return self.parts.tokens

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
                    exact: Callable[[], LocalBuffer] | None,
                    on_start: Callable[[], None] | None = None) -> Callable[[], EncodedObject]:
        """The encode closure of one part (runs on the scheduler's encode thread)."""
        parts, has_body, scratch = self.parts, self.parts.body_bytes > 0, self.scratch

        def encode() -> EncodedObject:
            if on_start is not None:
                on_start()
            anchor = region(StreamKind.ANCHOR)[: parts.anchor_bytes]
            body = region(StreamKind.RESIDUAL)[: parts.body_bytes] if has_body else None
            a_spans, b_spans = parts.encode_part(self.k_layers, self.v_layers, end_page, last, anchor, scratch, body)
            spans = {StreamKind.ANCHOR: tuple(a_spans)}
            residual = None
            if body is not None:
                spans[StreamKind.RESIDUAL] = tuple(b_spans)
                residual = LocalBuffer(body.data_ptr(), parts.body_bytes)
            return EncodedObject(LocalBuffer(anchor.data_ptr(), parts.anchor_bytes), residual,
                                 exact if last else None, spans, final=last)

        return encode
