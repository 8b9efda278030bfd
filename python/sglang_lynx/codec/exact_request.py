"""A request's exact stream (``lynx-exact``'s third stream): layer exact streams of runs of pages, appended
in the order they were encoded.

Lifecycle (the transport's third stream, ``integration/transport``). The prefill encodes a request's
anchor and residual as ``lynx``, whole (``request.encode_request``) or part by part while its prefill runs
(``stream_parts``). After the whole request, or after each part, an :class:`ExactRequestWriter` appends
one **piece** per layer K / V the part completed pages of: the ``lynx_exact`` stream of those pages alone
(a value's bin depends only on its page block: header, group statistics, codes; never on the trailer or on
another page), so a request streamed during its prefill has most of its exact stream on the wire before
its prefill ends. The writer's last call closes the stream. The size depends on the values: the receiver
preallocates :func:`exact_request_capacity` (from shapes, as for anchor and residual:
:data:`EXACT_CAPACITY_BITS` per value plus fixed overheads per page) and the sender's descriptor says how
many bytes came; a piece that would not fit is not written (:class:`ExactStreamTooLarge`: the request
takes the decode's recompute fallback, which is exact too). The decode side, once the three streams
landed, calls :func:`decode_exact_request_into` to overwrite the request's pool slots with the original
BF16 KV (the values an earlier stage wrote there are replaced).

Both sides take ``impl``: the per-layer codec (``lynx_exact``, the reference, by default; the C fast path
``sglang_lynx.kernels.lynx_exact_cpu`` gives the same bytes), and ``run_pieces`` (:data:`PieceRunner`): how
the pieces of one call are coded, ``[f(x) for x in xs]`` on the calling thread by default; a caller with
threads to spare passes a pool's map (the C path and zstandard release the GIL). The bytes and tensors
are the same either way: results are taken in order and written by the calling thread.

Layout (little-endian; ``P`` = ``page_tokens``, ``T`` = the request's tokens)::

    "LXR2"                                4 bytes
    piece*                                in the order they were encoded:
        layer u16, kind u8 (0 K, 1 V), 0 u8, first_page u32, end_page u32, size u32
        size bytes: the ``lynx_exact`` stream (``blocks=True``) of the layer's tokens
        [first_page * P, min(end_page * P, T)) against those pages' blocks (the layer header with page 0)
    "LXRE", pieces u32                    the end: a stream without it is incomplete

A layer's K (and its V) pieces come in page order and cover its pages once; pieces of different layers
and kinds interleave in any order.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import lynx_exact
from .base import EncodedKV, KVCodec, to_uint8_tensor
from .layout import page_sizes
from .lynx_exact import ExactStreamError
from .page_reuse_encode import block_spans
from .request import RequestPayload, request_spans

MAGIC, END_MAGIC = b"LXR2", b"LXRE"
PIECE = struct.Struct("<HBBIII")  # layer, kind, 0, first_page, end_page, size
END = struct.Struct("<4sI")
KINDS = ("k", "v")
#: The receiver's budget for the exact stream, in bits per value (real KV of the default model needs
#: ~2.5: ``benchmark/codec/results/bits_per_stream.json``), plus :data:`PIECE_OVERHEAD_BYTES` per page of a
#: layer K / V (a piece covers at least one page).
EXACT_CAPACITY_BITS = 6
#: A piece's header, its layer stream's header (``lynx_exact.HEADER``) and up to one zstd frame per rank
#: class, with room to spare.
PIECE_OVERHEAD_BYTES = 512
Span = tuple[int, int]  # (offset, length) in the exact stream
#: ``run_pieces(f, jobs) -> [f(job) for job in jobs]``, in that order, on whatever threads it likes.
PieceRunner = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


def run_in_order(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
    """The default :data:`PieceRunner`: each job on the calling thread, in order."""
    return [fn(job) for job in jobs]
PageRun = tuple[int, int, int]  # (layer, first page, end page): pages [first, end) of the layer's K and V


class ExactStreamTooLarge(ValueError):
    """The exact stream does not fit the region the decode reserved (:data:`EXACT_CAPACITY_BITS`)."""


def exact_request_capacity(num_layers: int, num_tokens: int, num_heads: int, head_dim: int, page_tokens: int) -> int:
    """The bytes a receiver reserves for a request's exact stream (an upper bound the sender must fit)."""
    pages = len(page_sizes(num_tokens, page_tokens))
    per_kind = -(-num_tokens * num_heads * head_dim * EXACT_CAPACITY_BITS // 8) + pages * PIECE_OVERHEAD_BYTES
    return len(MAGIC) + END.size + 2 * num_layers * per_kind


def require_exact_codec(codec: KVCodec) -> None:
    if not getattr(codec, "exact_stream", False):
        raise ValueError(f"codec {codec.name} has no exact stream (use lynx-exact)")
    if codec.params.sink_tokens > codec.params.page_tokens:
        raise ValueError(f"lynx-exact codes pages alone: sink_tokens ({codec.params.sink_tokens}) must fit in "
                         f"a page ({codec.params.page_tokens} tokens)")  # fmt: skip


class PageLayout:
    """Where the blocks of a run of pages of one layer K / V sit in a request's anchor and residual."""

    def __init__(self, codec: KVCodec, num_layers: int, tokens: int, heads: int, dim: int) -> None:
        self.codec, self.tokens, self.heads, self.dim = codec, tokens, heads, dim
        self.page = codec.params.page_tokens
        self.pages = len(page_sizes(tokens, self.page))
        ordered = request_spans(codec, num_layers, tokens, heads, dim)
        self.spans: dict[tuple[int, str], Any] = {(s.layer, s.kind): s for s in ordered}
        self.order: dict[tuple[int, str], int] = {(s.layer, s.kind): i for i, s in enumerate(ordered)}
        self.blocks = {kind: block_spans(codec, tokens, heads, dim, kind) for kind in KINDS}  # type: ignore[arg-type]
        self.no_sink = dataclasses.replace(codec.params, sink_tokens=0)

    def rows(self, first: int, end: int) -> tuple[int, int]:
        return first * self.page, min(end * self.page, self.tokens)

    def ranges(self, layer: int, kind: str, first: int, end: int) -> tuple[Span, Span, int]:
        """Where the blocks of pages ``[first, end)`` of a layer K / V lie: the anchor's ``(start, end)`` and
        the residual's in the request's streams (``request_spans``), and the index of the layer K / V's span
        (its place in request order)."""
        span, blocks = self.spans[(layer, kind)], self.blocks[kind]
        a0, a1 = (0 if first == 0 else blocks[first][0][0]), blocks[end - 1][0][1]
        r0, r1 = blocks[first][1][0], blocks[end - 1][1][1]
        return ((span.anchor_offset + a0, span.anchor_offset + a1),
                (span.residual_offset + r0, span.residual_offset + r1), self.order[(layer, kind)])

    def view(self, anchor: Tensor, residual: Tensor, layer: int, kind: str, first: int,
             end: int, residual_at: int | None = None) -> tuple[EncodedKV, Any]:
        """The piece's blocks as a layer of its own (``lynx_exact``'s ``blocks=True``) and its layout;
        ``residual_at``: where the residual blocks start in ``residual`` (default: the request layout's)."""
        (a0, a1), (r0, r1), _ = self.ranges(layer, kind, first, end)
        if residual_at is not None:
            r0, r1 = residual_at, residual_at + r1 - r0
        t0, t1 = self.rows(first, end)
        enc = EncodedKV(anchor[a0:a1], residual[r0:r1], t1 - t0, self.heads, self.dim, kind,  # type: ignore[arg-type]
                        self.codec.name)
        return enc, (self.codec.params if first == 0 else self.no_sink)

    def decode_piece(self, piece: Piece, anchor: Tensor, residual: Tensor, impl: Any,
                     residual_at: int | None = None, out: Tensor | None = None) -> tuple[int, int, Tensor]:
        """``(t0, t1, rows)``: the piece's token rows ``[t0, t1)`` and their BF16 values ``[t1 - t0, H, D]``,
        decoded by ``impl`` (``lynx_exact`` or a fast path) from the piece's anchor / residual blocks; into
        ``out`` (that shape, contiguous BF16) when given: written in place by an ``impl`` that can
        (``DECODES_INTO``: no new tensor, no copy), else copied there."""
        enc, params = self.view(anchor, residual, piece.layer, piece.kind, piece.first_page, piece.end_page,
                                residual_at)
        t0, t1 = self.rows(piece.first_page, piece.end_page)
        if (out is not None and getattr(impl, "DECODES_INTO", False) and out.is_contiguous()
                and out.device.type == "cpu"):  # fmt: skip
            return t0, t1, impl.decode_exact(enc, piece.data, params, blocks=True, out=out)
        rows = impl.decode_exact(enc, piece.data, params, blocks=True)
        return t0, t1, rows if out is None else out.copy_(rows)


class ExactRequestWriter:
    """Appends a request's exact stream into ``out`` (uint8, its send region) piece by piece.

    Pure transform over caller-owned tensors (one writer per request, called by one thread at a time):
    :meth:`write` codes runs of pages whose anchor and residual blocks are in ``anchor`` / ``residual``
    (the request's whole streams, ``request_spans`` layout) and whose BF16 rows are in the layers."""

    def __init__(self, codec: KVCodec, num_layers: int, tokens: int, heads: int, dim: int, out: Tensor,
                 impl: Any = lynx_exact, run_pieces: PieceRunner = run_in_order) -> None:
        require_exact_codec(codec)
        if out.dtype != torch.uint8 or out.dim() != 1:
            raise TypeError(f"the exact stream's buffer must be 1-D uint8, got {out.dtype} {tuple(out.shape)}")
        self.layout = PageLayout(codec, num_layers, tokens, heads, dim)
        self.out, self.impl, self.num_layers, self.run_pieces = out, impl, num_layers, run_pieces
        self.next_page = {(layer, kind): 0 for layer in range(num_layers) for kind in KINDS}
        self.length, self.pieces, self.closed = 0, 0, False

    def _put(self, data: bytes) -> None:
        end = self.length + len(data)
        if end > self.out.numel():
            values = 2 * self.num_layers * self.layout.tokens * self.layout.heads * self.layout.dim
            raise ExactStreamTooLarge(f"exact stream of {end}+ bytes ({8 * end / values:.2f}+ bits/value) exceeds "
                                      f"the decode's region of {self.out.numel()} bytes")  # fmt: skip
        if data:
            self.out[self.length : end].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.length = end

    def write(self, k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], anchor: Tensor, residual: Tensor,
              runs: Sequence[PageRun], last: bool = False) -> Span:
        """Append the pieces of ``runs`` (K then V of each; empty runs skipped; ``last``: then close the
        stream, every page of every layer coded). Returns the span written."""
        if self.closed:
            raise ValueError("the request's exact stream is already closed")
        start, pages = self.length, self.layout
        jobs, following = [], dict(self.next_page)
        for layer, first, end in runs:  # every piece checked before any is coded or written
            if end <= first:
                continue
            for kind in KINDS:
                if not 0 <= layer < self.num_layers or following[(layer, kind)] != first or end > pages.pages:
                    raise ValueError(f"pages [{first}, {end}) of layer {layer} {kind} do not follow its pages "
                                     f"[0, {following.get((layer, kind))}) of {pages.pages}")  # fmt: skip
                following[(layer, kind)] = end
                enc, params = pages.view(anchor, residual, layer, kind, first, end)
                t0, t1 = pages.rows(first, end)
                x = (k_layers if kind == "k" else v_layers)[layer][t0:t1].cpu()
                jobs.append((layer, kind, first, end, x, enc, params))
        coded = self.run_pieces(lambda job: self.impl.encode_exact(job[4], job[5], job[6], blocks=True), jobs)
        if start == 0:
            self._put(MAGIC)
        for (layer, kind, first, end, *_), data in zip(jobs, coded, strict=True):
            self._put(PIECE.pack(layer, KINDS.index(kind), 0, first, end, len(data)) + data)
            self.next_page[(layer, kind)], self.pieces = end, self.pieces + 1
        if last:
            short = [key for key, page in self.next_page.items() if page != pages.pages]
            if short:
                raise ValueError(f"closing an exact stream with pages missing (layer, kind: {short[:4]})")
            self._put(END.pack(END_MAGIC, self.pieces))
            self.closed = True
        return start, self.length - start

    def write_whole(self, k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], anchor: Tensor,
                    residual: Tensor) -> Span:
        """The whole request in one go (one piece per layer K / V), closed."""
        runs = [(layer, 0, self.layout.pages) for layer in range(self.num_layers)]
        return self.write(k_layers, v_layers, anchor, residual, runs, last=True)


def encode_exact_request(
    k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], payload: RequestPayload, codec: KVCodec,
    impl: Any = lynx_exact,
) -> bytes:
    """The request's exact stream in one go (one piece per layer K / V): each layer's BF16 K / V
    (``[T, H, D]``) against ``payload`` (its ``encode_request(k_layers, v_layers, codec)``)."""
    require_exact_codec(codec)
    if len(k_layers) != payload.num_layers or len(v_layers) != payload.num_layers:
        raise ValueError(f"payload has {payload.num_layers} layers, got {len(k_layers)} K and {len(v_layers)} V")
    t, h, d = payload.num_tokens, payload.num_heads, payload.head_dim
    out = torch.empty(exact_request_capacity(payload.num_layers, t, h, d, codec.params.page_tokens), dtype=torch.uint8)
    writer = ExactRequestWriter(codec, payload.num_layers, t, h, d, out, impl)
    writer.write_whole(k_layers, v_layers, payload.anchor, payload.residual)
    return out[: writer.length].numpy().tobytes()


@dataclass(frozen=True)
class Piece:
    layer: int
    kind: str
    first_page: int
    end_page: int
    data: bytes


class PieceParser:
    """Reads a request's exact stream piece by piece, as far as its bytes are there: :meth:`feed` returns
    the pieces wholly inside the first ``end`` bytes that were not returned yet, each checked to follow
    its layer K / V's pages (:class:`ExactStreamError` otherwise); ``ended`` once the end record is read.
    The stream may grow between calls (the receiver reads it while it lands); bytes already read must
    not change."""

    def __init__(self, num_layers: int, pages: int) -> None:
        self.num_layers, self.pages = num_layers, pages
        self.next_page = {(layer, kind): 0 for layer in range(num_layers) for kind in KINDS}
        self.offset, self.count, self.ended = 0, 0, False

    def feed(self, data: bytes | bytearray | memoryview, end: int) -> list[Piece]:
        view, pieces = memoryview(data), list[Piece]()
        if self.offset == 0:
            if end < len(MAGIC):
                return pieces
            if bytes(view[: len(MAGIC)]) != MAGIC:
                raise ExactStreamError(f"not a lynx-exact request stream (magic {bytes(view[:4])!r})")
            self.offset = len(MAGIC)
        while not self.ended and self.offset + END.size <= end:
            if bytes(view[self.offset : self.offset + len(END_MAGIC)]) == END_MAGIC:
                _, count = END.unpack_from(view, self.offset)
                if count != self.count or any(page != self.pages for page in self.next_page.values()):
                    raise ExactStreamError(
                        f"the request exact stream covers {sum(self.next_page.values())} of "
                        f"{2 * self.num_layers * self.pages} layer pages in {self.count} pieces (its end says {count})")
                self.offset, self.ended = self.offset + END.size, True
                break
            if self.offset + PIECE.size > end:
                break
            layer, kind_index, _, first, last, size = PIECE.unpack_from(view, self.offset)
            kind = KINDS[kind_index] if kind_index < len(KINDS) else "?"
            if self.next_page.get((layer, kind)) != first or not first < last <= self.pages:
                raise ExactStreamError(f"a piece of the request exact stream (layer {layer}, kind {kind_index}, "
                                       f"pages [{first}, {last}), {size} bytes) does not fit a {self.num_layers}-layer "
                                       f"request of {self.pages} pages")  # fmt: skip
            start = self.offset + PIECE.size
            if start + size > end:
                break
            pieces.append(Piece(layer, kind, first, last, bytes(view[start : start + size])))
            self.next_page[(layer, kind)], self.offset, self.count = last, start + size, self.count + 1
        return pieces


def parse_exact_request(exact: bytes | bytearray | memoryview, num_layers: int, pages: int) -> list[Piece]:
    """The pieces of a request's exact stream, in stream order, checked to cover every page of every layer
    K / V once, in page order, and to end where the stream ends (:class:`ExactStreamError` otherwise)."""
    data = bytes(exact)
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + END.size:
        raise ExactStreamError(f"not a lynx-exact request stream (magic {data[:4]!r}, {len(data)} bytes)")
    parser = PieceParser(num_layers, pages)
    pieces = parser.feed(data, len(data))
    if not parser.ended:
        what = "is cut short" if parser.offset + PIECE.size > len(data) else "has no end (incomplete)"
        raise ExactStreamError(f"the request exact stream {what} after {parser.count} pieces")
    if parser.offset != len(data):
        raise ExactStreamError(f"the request exact stream has {len(data) - parser.offset} bytes after its end")
    return pieces


def decode_exact_request_into(
    anchor: Tensor | bytes,
    residual: Tensor | bytes,
    exact: bytes | bytearray | memoryview,
    k_pool_layers: Sequence[Tensor],
    v_pool_layers: Sequence[Tensor],
    slot_indices: Tensor,
    *,
    codec: KVCodec,
    impl: Any = lynx_exact,
    run_pieces: PieceRunner = run_in_order,
) -> None:
    """Write the original BF16 KV of a request into the (bf16) pool slots ``slot_indices`` (int64)."""
    require_exact_codec(codec)
    if len(k_pool_layers) != len(v_pool_layers) or not k_pool_layers:
        raise ValueError(f"need as many K as V pool layers (>= 1), got {len(k_pool_layers)}, {len(v_pool_layers)}")
    if any(pool.dtype != torch.bfloat16 for pool in (*k_pool_layers, *v_pool_layers)):
        raise TypeError("lynx-exact restores BF16 KV: the KV pool must be bf16")
    if slot_indices.dtype != torch.int64 or slot_indices.dim() != 1:
        raise TypeError(f"slot_indices must be 1-D int64, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    anchor_t, residual_t = to_uint8_tensor(anchor, "anchor"), to_uint8_tensor(residual, "residual")
    tokens, heads, dim = int(slot_indices.numel()), int(k_pool_layers[0].shape[1]), int(k_pool_layers[0].shape[2])
    spans = request_spans(codec, len(k_pool_layers), tokens, heads, dim)
    last = spans[-1]
    if (anchor_t.numel(), residual_t.numel()) != (last.anchor_offset + last.anchor_bytes,
                                                  last.residual_offset + last.residual_bytes):  # fmt: skip
        raise ValueError(f"request streams of {anchor_t.numel()} + {residual_t.numel()} bytes do not fit "
                         f"{len(k_pool_layers)} layers x [{tokens}, {heads}, {dim}]")  # fmt: skip
    layout = PageLayout(codec, len(k_pool_layers), tokens, heads, dim)
    pieces = parse_exact_request(exact, len(k_pool_layers), layout.pages)
    decoded = run_pieces(lambda piece: layout.decode_piece(piece, anchor_t, residual_t, impl), pieces)
    for piece, (t0, t1, rows) in zip(pieces, decoded, strict=True):
        pool = (k_pool_layers if piece.kind == "k" else v_pool_layers)[piece.layer]
        pool.index_copy_(0, slot_indices[t0:t1].to(pool.device), rows.to(pool.device))
