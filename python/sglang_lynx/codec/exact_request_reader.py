"""Restoring a request's BF16 KV from its exact stream while the streams land (``lynx-exact``'s receiver).

The prefill sends a request streamed during its prefill part by part (``exact_request``): each part's
anchor and residual blocks, then the exact pieces of the pages that part completed. A piece needs only
its own pages' blocks of the anchor and of the residual (and the layer header with page 0), so the
receiver can restore it as soon as those bytes and the piece's are there, long before the last part
lands. :class:`ExactRequestReader` is that reader, a pure transform over byte buffers the caller owns
(no transport, no threads of its own: ``run_pieces`` says where the pieces are decoded): the caller says
which bytes of each stream are in place, and :meth:`ExactRequestReader.take` restores every piece it can
into the caller's tensors.

The residual on the wire (``wire_residual``) leaves out each layer's last ``tail`` bytes (its anchor's
trailer carries them, known only once the whole anchor landed); a piece whose residual blocks reach into
that tail waits for :meth:`ExactRequestReader.finish`, which takes the request's whole residual
(``residual_from_wire``) and restores whatever is left. Invariants: each piece is restored once, into
the rows of its pages; ``finish`` succeeds only when the stream ended and every page of every layer K / V
was restored, so the tensors then hold what ``decode_exact_request_into`` writes, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from . import lynx_exact
from .base import KVCodec
from .exact_request import PageLayout, Piece, PieceParser, PieceRunner, require_exact_codec, run_in_order
from .lynx_exact import ExactStreamError

Covered = Callable[[int, int], bool]  # covered(start, end): are the stream's bytes [start, end) in place?


class ExactRequestReader:
    """One request's exact stream, read and restored piece by piece (module docstring)."""

    def __init__(self, codec: KVCodec, num_layers: int, tokens: int, heads: int, dim: int,
                 residual_tail: int = 0, impl: Any = lynx_exact, run_pieces: PieceRunner = run_in_order) -> None:
        require_exact_codec(codec)
        self.layout = PageLayout(codec, num_layers, tokens, heads, dim)
        self.parser = PieceParser(num_layers, self.layout.pages)
        self.tail, self.impl, self.run_pieces = residual_tail, impl, run_pieces
        self.waiting: list[Piece] = []  # read, not restored yet (their anchor / residual blocks not there)
        self.restored = 0  # pieces restored so far
        self.restored_rows = 0  # token rows of layer K / V restored so far (of 2 x layers x tokens)

    def _wire_residual(self, piece: Piece) -> tuple[int, int] | None:
        """The piece's residual blocks in the residual body on the wire, None when they reach into the
        tail the body leaves out."""
        _, (r0, r1), index = self.layout.ranges(piece.layer, piece.kind, piece.first_page, piece.end_page)
        span = self.layout.spans[(piece.layer, piece.kind)]
        if r1 > span.residual_offset + span.residual_bytes - self.tail:
            return None
        return r0 - index * self.tail, r1 - index * self.tail

    def _restore(self, pieces: Sequence[tuple[Piece, int | None]], anchor: Tensor, residual: Tensor,
                 k_out: Sequence[Tensor], v_out: Sequence[Tensor]) -> None:
        """Decode ``(piece, residual_at)`` pairs (through ``run_pieces``) into their rows of ``k_out`` / ``v_out``."""
        def dest(piece: Piece) -> Tensor:
            t0, t1 = self.layout.rows(piece.first_page, piece.end_page)
            return (k_out if piece.kind == "k" else v_out)[piece.layer][t0:t1]

        decoded = self.run_pieces(lambda job: self.layout.decode_piece(job[0], anchor, residual, self.impl, job[1],
                                                                       dest(job[0])), pieces)  # fmt: skip
        for t0, t1, _ in decoded:
            self.restored, self.restored_rows = self.restored + 1, self.restored_rows + t1 - t0

    def take(self, exact: bytes | bytearray | memoryview, exact_landed: int, anchor: Tensor, anchor_covered: Covered,
             residual_body: Tensor, residual_covered: Covered, k_out: Sequence[Tensor],
             v_out: Sequence[Tensor]) -> int:
        """Read the pieces within the first ``exact_landed`` bytes of the exact stream and restore every
        piece read so far whose anchor and residual blocks are covered, into ``k_out[layer]`` /
        ``v_out[layer]`` (``[T, H, D]`` bf16, the request's tokens in order). ``anchor`` and
        ``residual_body`` are the staging bytes of the two streams (the residual as on the wire); only
        their covered bytes are read. Returns how many pieces it restored now."""
        self.waiting += self.parser.feed(exact, exact_landed)
        before, still, ready = self.restored, [], []
        for piece in self.waiting:
            (a0, a1), _, _ = self.layout.ranges(piece.layer, piece.kind, piece.first_page, piece.end_page)
            wire = self._wire_residual(piece)
            if wire is None or not anchor_covered(a0, a1) or not residual_covered(*wire):
                still.append(piece)
                continue
            ready.append((piece, wire[0]))
        self._restore(ready, anchor, residual_body, k_out, v_out)
        self.waiting = still
        return self.restored - before

    def finish(self, exact: bytes | bytearray | memoryview, anchor: Tensor, residual: Tensor,
               k_out: Sequence[Tensor], v_out: Sequence[Tensor]) -> None:
        """Every stream landed: read the rest of the exact stream (``exact``: all of it) and restore every
        piece not restored yet against the whole ``anchor`` and ``residual`` (the request layout's,
        ``residual_from_wire``). :class:`ExactStreamError` when the stream is incomplete or malformed."""
        self.waiting += self.parser.feed(exact, len(exact))
        if not self.parser.ended or self.parser.offset != len(exact):
            raise ExactStreamError(f"the request exact stream of {len(exact)} bytes does not end where it should "
                                   f"(read to {self.parser.offset}, ended: {self.parser.ended})")
        self._restore([(piece, None) for piece in self.waiting], anchor, residual, k_out, v_out)
        self.waiting = []
        if self.restored != self.parser.count:
            raise ExactStreamError(f"restored {self.restored} of the stream's {self.parser.count} pieces")
