"""Whole-request encode/decode for the transport, on the fastest exact path this host has.

The torch reference (``sglang_lynx.codec.request``) is the definition; for the ``lynx`` family at
``alpha = 0`` on the CPU, the C fast path (``sglang_lynx.kernels.lynx_cpu_fast``) produces the same
bytes several times faster (``benchmark/kernels/RESULTS.md``), so the prefill side encodes and the
decode side dequantizes with it. The stream layout is the reference's: anchors of ``k_0..k_{L-1},
v_0..v_{L-1}`` back to back, then the residuals in the same order.

Which path a server takes is decided once, at start-up (:func:`prepare_fast_path`, from the KV
manager's constructor): the library built by the set-up is loaded and checked against the reference,
and one log line says which codec path the server runs. Nothing is compiled or checked on a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from sglang_lynx.codec.base import KVCodec
from sglang_lynx.codec.layout import Kind, LayoutParams
from sglang_lynx.codec.page_reuse_encode import (
    PageEncoder,
    ReferencePageEncoder,
    Stream,
    encode_streams_with_cache,
)
from sglang_lynx.codec.request import decode_request_into, encode_request, request_spans
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.page_cache import PageReuse

logger = logging.getLogger("sglang_lynx.transport")


# A pure cache of immutable results (did the fast module agree with the reference, per codec and
# device): module-level on purpose, the same answer for every server in the process.
_SELF_CHECKED: dict[tuple[str, str], bool] = {}


def _fast_module(codec: KVCodec, config: LynxConfig, device: torch.device):  # noqa: ANN202
    """The C fast path if it applies here and, checked once per process, still produces the reference's
    bytes (the codec's format may evolve faster than the kernel): else None."""
    if device.type != "cpu" or config.alpha != 0.0:
        return None
    try:
        from sglang_lynx.kernels import lynx_cpu_fast
    except ImportError:
        return None
    if codec.name not in lynx_cpu_fast.CODEC_NAMES:
        return None
    key = (codec.name, config.to_json())
    if key not in _SELF_CHECKED:
        _SELF_CHECKED[key] = _self_check(lynx_cpu_fast, codec, config)
    return lynx_cpu_fast if _SELF_CHECKED[key] else None


def _self_check(fast, codec: KVCodec, config: LynxConfig) -> bool:  # noqa: ANN001
    try:
        x = torch.randn(2 * config.page_tokens + 7, 2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        for kind in ("k", "v"):
            got = fast.encode(x, kind, params=_params(config), codec_name=codec.name)
            want = codec.encode(x, kind)
            if not (torch.equal(got.anchor, want.anchor) and torch.equal(got.residual, want.residual)):
                logger.warning("lynx: the CPU fast path disagrees with the %s reference; using the reference",
                               codec.name)
                return False
        return True
    except Exception as exc:  # not built (no C compiler at set-up), or a format the kernel does not know
        logger.warning("lynx: CPU fast path unavailable (%s); using the torch reference", exc)
        return False


def prepare_fast_path(codec: KVCodec, config: LynxConfig, device: torch.device) -> str:
    """At start-up: load and check the fast path for this server's codec and device; log and return which
    codec path the server runs ("C fast path" or "torch reference")."""
    fast = _fast_module(codec, config, device)
    path = "C fast path" if fast is not None else "torch reference"
    logger.info("sglang-lynx: %s codec on %s: %s", codec.name, device.type, path)
    return path


def _params(config: LynxConfig) -> LayoutParams:
    return LayoutParams(page_tokens=config.page_tokens, chunk_tokens=config.chunk_tokens,
                        group_size=config.group_size, sink_tokens=config.sink_tokens,
                        value_group_size=config.value_group_size, recent_tokens=config.recent_tokens)


class FastPageEncoder:
    """``codec.page_reuse_encode.PageEncoder`` on the C fast path (the reference's bytes)."""

    checks_values = True  # the C pass rejects NaN / Inf with the reference's error

    def __init__(self, codec: KVCodec, params: LayoutParams) -> None:
        from sglang_lynx.kernels.lynx_cpu_pages import encode_pages_into

        self.codec, self.params, self._into = codec, params, encode_pages_into

    def blocks_into(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None,
                    anchor: Tensor, residual: Tensor) -> None:
        self._into(x, kind, first_page, count, anchor, residual, params=self.params, layer=layer,
                   codec_name=self.codec.name)


def encode_request_streams(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], codec: KVCodec,
                           config: LynxConfig, reuse: PageReuse | None = None) -> tuple[Tensor, Tensor]:
    """(anchor, residual) uint8 streams of a whole request; with ``reuse``, full pages found in its cache
    (same prefix, same KV slots) are copied instead of encoded, and the others are stored there."""
    fast = _fast_module(codec, config, k_layers[0].device)
    if reuse is not None:
        return _encode_with_reuse(k_layers, v_layers, codec, config, reuse, fast is not None)
    if fast is None:
        payload = encode_request(k_layers, v_layers, codec)
        return payload.anchor, payload.residual
    params = _params(config)
    anchors, residuals = [], []
    for kind, layers in (("k", k_layers), ("v", v_layers)):
        for layer, x in enumerate(layers):
            enc = fast.encode(x, kind, params=params, layer=layer, codec_name=codec.name)
            anchors.append(enc.anchor)
            residuals.append(enc.residual)
    return torch.cat(anchors), torch.cat(residuals)


def _encode_with_reuse(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], codec: KVCodec, config: LynxConfig,
                       reuse: PageReuse, fast: bool) -> tuple[Tensor, Tensor]:
    encoder: PageEncoder = FastPageEncoder(codec, _params(config)) if fast else ReferencePageEncoder(codec)
    streams: list[Stream] = [("k", layer, x) for layer, x in enumerate(k_layers)]
    streams += [("v", layer, x) for layer, x in enumerate(v_layers)]
    return encode_streams_with_cache(encoder, streams, reuse.page_hashes, reuse.cache, reuse.slot_hashes, reuse.epoch)


def decode_request_streams(anchor: Tensor, residual: Tensor | None, k_pool: Sequence[Tensor],
                           v_pool: Sequence[Tensor], slots: Tensor, codec: KVCodec, config: LynxConfig) -> None:
    """Dequantize a request's streams into its pool slots (anchor-only when ``residual`` is None)."""
    fast = _fast_module(codec, config, k_pool[0].device)
    if fast is None:
        decode_request_into((anchor, residual), k_pool, v_pool, slots, with_residual=residual is not None,
                            codec=codec)
        return
    heads, dim = int(k_pool[0].shape[1]), int(k_pool[0].shape[2])
    params = _params(config)
    for span in request_spans(codec, len(k_pool), int(slots.numel()), heads, dim):
        pool = (k_pool if span.kind == "k" else v_pool)[span.layer]
        a = anchor[span.anchor_offset: span.anchor_offset + span.anchor_bytes]
        r = None if residual is None else residual[span.residual_offset: span.residual_offset + span.residual_bytes]
        fast.decode_into(a, r, pool, slots, kind=span.kind, params=params)
