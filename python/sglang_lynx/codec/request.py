"""Whole-request helpers for the transport: all layers' K and V in two contiguous streams.

Lifecycle: the prefill side calls ``encode_request`` once per request (after prefill) and ships
``payload.anchor`` first, then ``payload.residual``. The decode side preallocates both buffers with
``request_stream_bytes`` (shapes only), then calls ``decode_request_into(..., with_residual=False)``
when the anchor lands (progressive) or ``with_residual=True`` when both landed, and
``upgrade_request_into`` when the residual lands after an anchor-only decode (the full reconstruction
is recomputed from anchor + residual and overwrites the pool slots in place).

Layout (fixed order, offsets from shapes alone): the anchor stream is the anchor streams of
``k_0, k_1, ..., k_{L-1}, v_0, ..., v_{L-1}`` back to back, each ``layout.stream_bytes(...)[0]`` long;
the residual stream is the residual streams in the same order. No header, no padding.

Pool layout: ``k_pool_layers[layer]`` is SGLang's ``k_buffer[layer]``, ``[pool_slots, kv_heads,
head_dim]`` in the model dtype; token i of the request goes to slot ``slot_indices[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import BytesLike, EncodedKV, KVCodec, to_uint8_tensor
from .layout import Kind


@dataclass
class RequestPayload:
    anchor: Tensor  # uint8, contiguous, all layers
    residual: Tensor  # uint8, contiguous, all layers (empty for one-stream schemes)
    num_layers: int
    num_tokens: int
    num_heads: int
    head_dim: int
    codec_name: str


@dataclass(frozen=True)
class LayerSpan:
    kind: Kind
    layer: int
    anchor_offset: int
    anchor_bytes: int
    residual_offset: int
    residual_bytes: int


def request_spans(codec: KVCodec, num_layers: int, num_tokens: int, num_heads: int, head_dim: int) -> list[LayerSpan]:
    """Where each (kind, layer) lives in the two request streams, in stream order."""
    spans = []
    a_off = r_off = 0
    for kind in ("k", "v"):
        a_len, r_len = codec.stream_bytes(num_tokens, num_heads, head_dim, kind)  # type: ignore[arg-type]
        for layer in range(num_layers):
            spans.append(LayerSpan(kind, layer, a_off, a_len, r_off, r_len))  # type: ignore[arg-type]
            a_off += a_len
            r_off += r_len
    return spans


def request_stream_bytes(
    codec: KVCodec, num_layers: int, num_tokens: int, num_heads: int, head_dim: int
) -> tuple[int, int]:
    """(anchor, residual) bytes of a whole request: what the receiver preallocates."""
    spans = request_spans(codec, num_layers, num_tokens, num_heads, head_dim)
    last = spans[-1]
    return last.anchor_offset + last.anchor_bytes, last.residual_offset + last.residual_bytes


def encode_request(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], codec: KVCodec) -> RequestPayload:
    """Encode every layer's K and V (each ``[T, H, D]``) into one anchor and one residual buffer."""
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError(f"need as many K as V layers (>= 1), got {len(k_layers)} and {len(v_layers)}")
    shape = tuple(k_layers[0].shape)
    anchors: list[Tensor] = []
    residuals: list[Tensor] = []
    for kind, layers in (("k", k_layers), ("v", v_layers)):
        for layer, x in enumerate(layers):
            if tuple(x.shape) != shape:
                raise ValueError(f"layer {layer} {kind}: shape {tuple(x.shape)} differs from layer 0 K {shape}")
            enc = codec.encode(x, kind, layer=layer)  # type: ignore[arg-type]
            anchors.append(enc.anchor)
            residuals.append(enc.residual)
    tokens, heads, dim = (int(s) for s in shape)
    return RequestPayload(torch.cat(anchors), torch.cat(residuals), len(k_layers), tokens, heads, dim, codec.name)


def _streams(
    payload_or_bytes: RequestPayload | tuple[BytesLike, BytesLike | None], with_residual: bool
) -> tuple[Tensor, Tensor | None]:
    if isinstance(payload_or_bytes, RequestPayload):
        return payload_or_bytes.anchor, payload_or_bytes.residual if with_residual else None
    anchor_raw, residual_raw = payload_or_bytes
    anchor = to_uint8_tensor(anchor_raw, "anchor")
    if with_residual and residual_raw is None:
        raise ValueError("with_residual=True but no residual bytes were given")
    residual = to_uint8_tensor(residual_raw, "residual") if with_residual and residual_raw is not None else None
    return anchor, residual


def decode_request_into(
    payload_or_bytes: RequestPayload | tuple[BytesLike, BytesLike | None],
    k_pool_layers: Sequence[Tensor],
    v_pool_layers: Sequence[Tensor],
    slot_indices: Tensor,
    *,
    with_residual: bool,
    codec: KVCodec,
) -> None:
    """Dequantize a request into the KV pool slots ``slot_indices`` (int64, one per token)."""
    if len(k_pool_layers) != len(v_pool_layers) or not k_pool_layers:
        raise ValueError(f"need as many K as V pool layers (>= 1), got {len(k_pool_layers)}, {len(v_pool_layers)}")
    if slot_indices.dtype != torch.int64 or slot_indices.dim() != 1:
        raise TypeError(f"slot_indices must be 1-D int64, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    tokens = int(slot_indices.numel())
    heads, dim = int(k_pool_layers[0].shape[1]), int(k_pool_layers[0].shape[2])
    if isinstance(payload_or_bytes, RequestPayload):
        p = payload_or_bytes
        if (p.num_layers, p.num_tokens, p.num_heads, p.head_dim) != (len(k_pool_layers), tokens, heads, dim):
            raise ValueError(
                f"payload is {p.num_layers} layers x [{p.num_tokens}, {p.num_heads}, {p.head_dim}] but the pool "
                f"is {len(k_pool_layers)} layers x [{tokens} slots, {heads}, {dim}]"
            )
    anchor, residual = _streams(payload_or_bytes, with_residual)
    layers = len(k_pool_layers)
    want_anchor, want_residual = request_stream_bytes(codec, layers, tokens, heads, dim)
    if anchor.numel() != want_anchor:
        raise ValueError(f"request anchor has {anchor.numel()} bytes, expected {want_anchor}")
    if residual is not None and codec.two_streams and residual.numel() != want_residual:
        raise ValueError(f"request residual has {residual.numel()} bytes, expected {want_residual}")
    for span in request_spans(codec, layers, tokens, heads, dim):
        pool = (k_pool_layers if span.kind == "k" else v_pool_layers)[span.layer]
        res = (
            residual[span.residual_offset : span.residual_offset + span.residual_bytes]
            if residual is not None
            else torch.empty(0, dtype=torch.uint8)
        )
        enc = EncodedKV(
            anchor[span.anchor_offset : span.anchor_offset + span.anchor_bytes],
            res,
            tokens,
            heads,
            dim,
            span.kind,
            codec.name,
        )
        values = codec.decode(enc, with_residual=residual is not None, dtype=pool.dtype)
        pool.index_copy_(0, slot_indices.to(pool.device), values.to(pool.device))


def upgrade_request_into(
    payload_or_bytes: RequestPayload | tuple[BytesLike, BytesLike | None],
    k_pool_layers: Sequence[Tensor],
    v_pool_layers: Sequence[Tensor],
    slot_indices: Tensor,
    *,
    codec: KVCodec,
) -> None:
    """The residual landed after an anchor-only decode: overwrite the slots with the full reconstruction."""
    if not codec.two_streams:
        raise ValueError(f"codec {codec.name} has no residual stream to upgrade with")
    decode_request_into(payload_or_bytes, k_pool_layers, v_pool_layers, slot_indices, with_residual=True, codec=codec)
