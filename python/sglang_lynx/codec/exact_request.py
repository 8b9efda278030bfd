"""Whole-request exact stream of ``lynx-exact``: every layer's K and V exact stream in one buffer.

Lifecycle (the transport's third stream, ``integration/transport``). The prefill calls
``request.encode_request`` (anchor + residual, as ``lynx``) and then :func:`encode_exact_request` with
the same BF16 layers and payload; it ships the result after the residual, at a lower priority. Its
size depends on the values: the receiver preallocates :func:`exact_request_capacity` (from shapes, as
for anchor and residual: :data:`EXACT_CAPACITY_BITS` per value plus fixed headers) and the sender's
descriptor says how many bytes came; a stream that would not fit is not sent (its request takes the
decode's recompute fallback, which is exact too). The decode side, once the three streams landed,
calls :func:`decode_exact_request_into` to overwrite the request's pool slots with the original BF16
KV (the anchor-only values written there before are replaced).

Both functions take ``impl``: the per-layer codec (``lynx_exact``, the reference, by default; the C
fast path ``sglang_lynx.kernels.lynx_exact_cpu`` gives the same bytes).

Layout (little-endian)::

    "LXR1"                4 bytes
    pieces                u32: 2 * num_layers
    piece_bytes[pieces]   u32 each
    pieces                the layer exact streams (``lynx_exact``) of k_0 .. k_{L-1}, v_0 .. v_{L-1}
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import lynx_exact
from .base import EncodedKV, KVCodec, to_uint8_tensor
from .lynx_exact import ExactStreamError
from .request import RequestPayload, request_spans

MAGIC = b"LXR1"
COUNT = struct.Struct("<4sI")
#: The receiver's budget for the exact stream, in bits per value (real KV of the default model needs
#: ~2.5: ``benchmark/codec/results/bits_per_stream.json``), plus :data:`PIECE_OVERHEAD_BYTES` per layer K / V.
EXACT_CAPACITY_BITS = 6
#: A layer piece's header (``lynx_exact.HEADER``) and up to one zstd frame per rank class, with room to spare.
PIECE_OVERHEAD_BYTES = 512


def exact_request_capacity(num_layers: int, num_tokens: int, num_heads: int, head_dim: int) -> int:
    """The bytes a receiver reserves for a request's exact stream (an upper bound the sender must fit)."""
    pieces = 2 * num_layers
    per_piece = -(-num_tokens * num_heads * head_dim * EXACT_CAPACITY_BITS // 8) + PIECE_OVERHEAD_BYTES
    return COUNT.size + 4 * pieces + pieces * per_piece


def _require_exact_codec(codec: KVCodec) -> None:
    if not getattr(codec, "exact_stream", False):
        raise ValueError(f"codec {codec.name} has no exact stream (use lynx-exact)")


def encode_exact_request(
    k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], payload: RequestPayload, codec: KVCodec,
    impl: Any = lynx_exact,
) -> bytes:
    """The request's exact stream: each layer's BF16 K / V (``[T, H, D]``) against ``payload`` (its
    ``encode_request(k_layers, v_layers, codec)``)."""
    _require_exact_codec(codec)
    if len(k_layers) != payload.num_layers or len(v_layers) != payload.num_layers:
        raise ValueError(f"payload has {payload.num_layers} layers, got {len(k_layers)} K and {len(v_layers)} V")
    pieces = []
    for span in request_spans(codec, payload.num_layers, payload.num_tokens, payload.num_heads, payload.head_dim):
        x = (k_layers if span.kind == "k" else v_layers)[span.layer]
        enc = EncodedKV(
            payload.anchor[span.anchor_offset : span.anchor_offset + span.anchor_bytes],
            payload.residual[span.residual_offset : span.residual_offset + span.residual_bytes],
            payload.num_tokens, payload.num_heads, payload.head_dim, span.kind, codec.name,
        )  # fmt: skip
        pieces.append(impl.encode_exact(x, enc, codec.params))
    table = struct.pack(f"<{len(pieces)}I", *(len(p) for p in pieces))
    return b"".join([COUNT.pack(MAGIC, len(pieces)), table, *pieces])


def split_exact_request(exact: bytes | bytearray | memoryview, num_layers: int) -> list[bytes]:
    """The layer exact streams of a request's exact stream, in stream order (errors when malformed)."""
    data = bytes(exact)
    if len(data) < COUNT.size:
        raise ExactStreamError(f"request exact stream of {len(data)} bytes has no header")
    magic, count = COUNT.unpack_from(data)
    if magic != MAGIC or count != 2 * num_layers:
        raise ExactStreamError(f"not a lynx-exact request stream of {num_layers} layers (magic {magic!r}, "
                               f"{count} pieces)")  # fmt: skip
    if len(data) < COUNT.size + 4 * count:
        raise ExactStreamError("request exact stream is shorter than its table")
    sizes = struct.unpack_from(f"<{count}I", data, COUNT.size)
    offset = COUNT.size + 4 * count
    if offset + sum(sizes) != len(data):
        raise ExactStreamError(f"request exact stream has {len(data)} bytes, its table says {offset + sum(sizes)}")
    pieces = []
    for size in sizes:
        pieces.append(data[offset : offset + size])
        offset += size
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
) -> None:
    """Write the original BF16 KV of a request into the (bf16) pool slots ``slot_indices`` (int64)."""
    _require_exact_codec(codec)
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
    pieces = split_exact_request(exact, len(k_pool_layers))
    for span, piece in zip(spans, pieces, strict=True):
        enc = EncodedKV(
            anchor_t[span.anchor_offset : span.anchor_offset + span.anchor_bytes],
            residual_t[span.residual_offset : span.residual_offset + span.residual_bytes],
            tokens, heads, dim, span.kind, codec.name,
        )  # fmt: skip
        pool = (k_pool_layers if span.kind == "k" else v_pool_layers)[span.layer]
        pool.index_copy_(0, slot_indices.to(pool.device), impl.decode_exact(enc, piece, codec.params).to(pool.device))
