"""The residual on the wire: each layer's residual stream less the bytes its anchor's trailer carries.

``lynx``'s anchor stream of a layer ends with a trailer that repeats the residual nibbles of the layer's
last ``R = min(recent_tokens, T)`` tokens (``lynx_format``), so that the anchor alone decodes the recent
tokens at 8 bits. Those nibbles are exactly the last ``R * H * D / 2`` bytes of the layer's residual
stream (the residual is token-major nibbles, no metadata). Sending them again in the residual costs
``4 R / T`` bits per value (0.19 at 1K tokens), so the transport ships the request's residual *body*:

    body = for each (kind, layer) in request order (``request.request_spans``):
           that layer's residual stream without its last ``tail`` bytes

and the decode rebuilds the whole residual from the body and the landed anchor before it decodes
(:func:`residual_from_wire`): the pool receives byte for byte what it received from the whole residual.

``tail`` is the trailer's size when the layer's residual holds more than it (``T > R``), else 0: a
request of at most ``R`` tokens sends its residual whole, so a two-stream request always keeps a
non-empty residual stream. Codecs without a trailer (every one but ``lynx`` and its aliases) have
``tail == 0`` and an unchanged residual. Pure functions of their arguments (no transport, no threads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KVCodec
from .layout import residual_tail_bytes as layout_tail_bytes
from .request import request_spans


def residual_tail_bytes(codec: KVCodec, num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Bytes at the end of each layer's residual stream (K and V alike) that the wire leaves out."""
    return layout_tail_bytes(codec.name, num_tokens, num_heads, head_dim, codec.params) if codec.two_streams else 0


def residual_wire_bytes(codec: KVCodec, num_layers: int, num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Bytes of the request's residual on the wire (what the decode reserves and receives)."""
    spans = request_spans(codec, num_layers, num_tokens, num_heads, head_dim)
    whole = spans[-1].residual_offset + spans[-1].residual_bytes
    return whole - len(spans) * residual_tail_bytes(codec, num_tokens, num_heads, head_dim)


def residual_to_wire(residual: Tensor, codec: KVCodec, num_layers: int, num_tokens: int, num_heads: int,
                     head_dim: int) -> Tensor:  # fmt: skip
    """The body the prefill sends, from the request's whole residual stream (uint8)."""
    spans = request_spans(codec, num_layers, num_tokens, num_heads, head_dim)
    whole = spans[-1].residual_offset + spans[-1].residual_bytes
    if residual.numel() != whole:
        raise ValueError(f"request residual has {residual.numel()} bytes, expected {whole}")
    tail = residual_tail_bytes(codec, num_tokens, num_heads, head_dim)
    if tail == 0:
        return residual
    return torch.cat([residual[s.residual_offset : s.residual_offset + s.residual_bytes - tail] for s in spans])


def residual_from_wire(anchor: Tensor, body: Tensor, codec: KVCodec, num_layers: int, num_tokens: int,
                       num_heads: int, head_dim: int) -> Tensor:  # fmt: skip
    """The request's whole residual stream from the body the decode received and the request's anchor."""
    spans = request_spans(codec, num_layers, num_tokens, num_heads, head_dim)
    tail = residual_tail_bytes(codec, num_tokens, num_heads, head_dim)
    want_body = residual_wire_bytes(codec, num_layers, num_tokens, num_heads, head_dim)
    want_anchor = spans[-1].anchor_offset + spans[-1].anchor_bytes
    if body.numel() != want_body or anchor.numel() != want_anchor:
        raise ValueError(f"residual body of {body.numel()} bytes and anchor of {anchor.numel()} bytes, expected "
                         f"{want_body} and {want_anchor}")  # fmt: skip
    if tail == 0:
        return body
    whole = torch.empty(spans[-1].residual_offset + spans[-1].residual_bytes, dtype=torch.uint8, device=body.device)
    at = 0
    for s in spans:
        keep = s.residual_bytes - tail
        whole[s.residual_offset : s.residual_offset + keep] = body[at : at + keep]
        end = s.anchor_offset + s.anchor_bytes  # the layer's trailer ends its anchor stream
        whole[s.residual_offset + keep : s.residual_offset + s.residual_bytes] = anchor[end - tail : end]
        at += keep
    return whole
