"""Whole-request encode/decode for the transport, on the fastest exact path this host has.

The torch reference (``sglang_lynx.codec.request``) is the definition; for the ``lynx`` family at
``alpha = 0`` a kernel module produces the same bytes much faster, chosen by the KV pool's device
(:func:`kernel_module_name`):

- CPU: the C fast path (``sglang_lynx.kernels.lynx_cpu_fast``; ``benchmark/kernels/RESULTS.md``);
- CUDA: the Triton kernels (``sglang_lynx.kernels.lynx_triton``): the prefill encodes each layer on
  the GPU straight from the KV gathered out of its pool pages (one device gather per chunk) and copies
  the two streams into its registered send arena (pinned host memory on a CUDA server,
  ``transport.arena``); the decode copies a request's streams from its (pinned) receive arena to the
  GPU in one blocking copy per stream, then dequantizes on the GPU into the pool slots (the kernels
  are queued on the current stream, ahead of the next forward; the staging region is released only
  after the copy has finished, so no later transfer can overwrite bytes still being read);
- anything else (or alpha > 0, or a codec the kernels do not know): the torch reference, on the CPU
  whatever the KV pool's device (``REFERENCE_ON_THE_CPU`` below).

``lynx-exact`` sends ``lynx``'s anchor and residual (the same bytes, so the same kernels) and a third,
exact stream (``codec.exact_request``: pieces of page runs, one set per part of a request streamed during
its prefill): encoded on the CPU from the BF16 KV and the two other streams by the C fast path
(``sglang_lynx.kernels.lynx_exact_cpu``) where it is built and agrees with the reference, else by the
reference (:func:`exact_layer_codec`); the decode restores the BF16 values the same way and copies them
into the pool slots (a GPU codec for this stream is not built).

The stream layout is the reference's: anchors of ``k_0..k_{L-1}, v_0..v_{L-1}`` back to back, then
the residuals in the same order. Kernels run under ``torch.cuda.device(pool device)``: the prefill
encodes on SGLang's transfer thread, whose current device is 0 whatever GPU the server has, and a
Triton launch goes to the current device.

Which path a server takes is decided once, at start-up (:func:`prepare_fast_path`, from the KV
manager's constructor): the kernel module is loaded and checked against the reference (encode and
both decodes, on the server's device), and one log line says which codec path the server runs.
Nothing is compiled or checked on a request (Triton compiles its kernels in that start-up check).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from sglang_lynx.codec import exact_request
from sglang_lynx.codec.base import KVCodec
from sglang_lynx.codec.layout import Kind, LayoutParams
from sglang_lynx.codec.page_reuse_encode import (
    PageEncoder,
    ReferencePageEncoder,
    Stream,
    block_spans,
    encode_streams_with_cache,
)
from sglang_lynx.codec.request import decode_request_into, encode_request, request_spans
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.page_cache import PageReuse

logger = logging.getLogger("sglang_lynx.transport")

#: The kernel module of each device type, and how the start-up log names it.
KERNEL_MODULES: dict[str, tuple[str, str]] = {
    "cpu": ("lynx_cpu_fast", "C fast path"),
    "cuda": ("lynx_triton", "Triton kernels"),
}
REFERENCE_PATH = "torch reference"

# A pure cache of immutable results (did the kernel module agree with the reference, per codec,
# configuration and device type): module-level on purpose, the same answer for every server in the process.
_SELF_CHECKED: dict[tuple[str, str, str], bool] = {}


# REFERENCE_ON_THE_CPU: where no kernel module serves a non-CPU device, the torch reference still runs on
# the CPU (the prefill's KV copied to the host, the decode's values copied into the pool): on an H200 the
# reference run on CUDA tensors gave other values than on the CPU (torch's CUDA arithmetic is not the
# CPU's, bit for bit; benchmark/kernels/results/gpu-h200-2026-12-04), and the CPU is what defines the bytes.


def kernel_module_name(codec_name: str, alpha: float, device: torch.device | str) -> str | None:
    """The kernel module that may serve ``codec_name`` on ``device`` (pure: no import, no check), or
    None when only the torch reference applies (another device type, companding, another codec)."""
    entry = KERNEL_MODULES.get(torch.device(device).type)
    if entry is None or alpha != 0.0 or kernel_codec_name(codec_name) not in ("lynx", "lynx-int8", "lynx-int4"):
        return None
    return entry[0]


def kernel_codec_name(codec_name: str) -> str:
    """The codec whose anchor and residual bytes ``codec_name`` sends (``lynx-exact``: ``lynx``'s)."""
    return "lynx" if codec_name == "lynx-exact" else codec_name


def _import_kernels(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"sglang_lynx.kernels.{name}")
    except ImportError as exc:  # no triton, or no kernels package in this install
        logger.warning("lynx: codec kernels %s unavailable (%s); using the torch reference", name, exc)
        return None


def _fast_module(codec: KVCodec, config: LynxConfig, device: torch.device):  # noqa: ANN202
    """The kernel module for ``device`` if it applies and, checked once per process, still produces the
    reference's bytes (the codec's format may evolve faster than the kernels): else None."""
    device = torch.device(device)
    name = kernel_module_name(codec.name, config.alpha, device)
    if name is None:
        return None
    key = (codec.name, config.to_json(), device.type)
    if key in _SELF_CHECKED and not _SELF_CHECKED[key]:
        return None
    module = _import_kernels(name)
    if module is None or kernel_codec_name(codec.name) not in module.CODEC_NAMES:
        return None
    if key not in _SELF_CHECKED:
        _SELF_CHECKED[key] = _self_check(module, codec, config, device)
    return module if _SELF_CHECKED[key] else None


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for kernel launches (a CUDA device; nothing to do elsewhere)."""
    if device.type == "cuda" and torch.cuda.is_available():
        with torch.cuda.device(device):
            yield
    else:
        yield


def _self_check(fast: ModuleType, codec: KVCodec, config: LynxConfig, device: torch.device) -> bool:
    """Encode and decode (anchor-only and full) a random layer with ``fast`` on ``device`` and compare
    with the reference on the CPU: bytes and values must be identical."""
    try:
        x = torch.randn(2 * config.page_tokens + 7, 2, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        slots = torch.randperm(x.shape[0] + 5, generator=torch.Generator().manual_seed(1))[: x.shape[0]]
        params = _params(config)
        with on_device(device):
            for kind in ("k", "v"):
                got = fast.encode(x.to(device), kind, params=params, codec_name=kernel_codec_name(codec.name))
                want = codec.encode(x, kind)
                if not (torch.equal(got.anchor.cpu(), want.anchor) and torch.equal(got.residual.cpu(), want.residual)):
                    logger.warning("lynx: the %s disagree with the %s reference encode; using the reference",
                                   fast.__name__, codec.name)
                    return False
                for full in (False, True) if codec.two_streams else (False,):
                    pool = torch.zeros(x.shape[0] + 5, 2, 64, dtype=torch.bfloat16, device=device)
                    residual = want.residual.to(device) if full else None
                    fast.decode_into(want.anchor.to(device), residual, pool, slots.to(device), kind=kind,
                                     params=params)
                    expected = codec.decode(want, with_residual=full, dtype=torch.bfloat16)
                    if not torch.equal(pool.cpu()[slots], expected):
                        logger.warning("lynx: the %s disagree with the %s reference decode; using the reference",
                                       fast.__name__, codec.name)
                        return False
        return True
    except Exception as exc:  # not built (no C compiler at set-up), no GPU driver, a format the kernel lacks
        logger.warning("lynx: codec kernels unavailable on %s (%s); using the torch reference", device, exc)
        return False


def prepare_fast_path(codec: KVCodec, config: LynxConfig, device: torch.device) -> str:
    """At start-up: load and check the kernels for this server's codec and device; log and return which
    codec path the server runs ("C fast path", "Triton kernels" or "torch reference")."""
    device = torch.device(device)
    fast = _fast_module(codec, config, device)
    path = KERNEL_MODULES[device.type][1] if fast is not None else REFERENCE_PATH
    logger.info("sglang-lynx: %s codec on %s: %s", codec.name, device.type, path)
    return path


def _params(config: LynxConfig) -> LayoutParams:
    return LayoutParams(page_tokens=config.page_tokens, chunk_tokens=config.chunk_tokens,
                        group_size=config.group_size, sink_tokens=config.sink_tokens,
                        value_group_size=config.value_group_size, key_chunk_tokens=config.key_chunk_tokens,
                        recent_tokens=config.recent_tokens, kivi_recent_tokens=config.kivi_recent_tokens)


class FastPageEncoder:
    """``codec.page_reuse_encode.PageEncoder`` on the C fast path (the reference's bytes)."""

    checks_values = True  # the C pass rejects NaN / Inf with the reference's error

    def __init__(self, codec: KVCodec, params: LayoutParams) -> None:
        from sglang_lynx.kernels.lynx_cpu_pages import encode_pages_into

        self.codec, self.params, self._into = codec, params, encode_pages_into

    def blocks_into(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None,
                    anchor: Tensor, residual: Tensor) -> None:
        self._into(x, kind, first_page, count, anchor, residual, params=self.params, layer=layer,
                   codec_name=kernel_codec_name(self.codec.name))


class KernelPageEncoder:
    """``codec.page_reuse_encode.PageEncoder`` on a device kernel module's ``encode_pages_into`` (CUDA: the
    Triton kernels), run where the KV is. The layer's anchor may live elsewhere (the pinned send region):
    the pages are then encoded into a device buffer of the layer's anchor size and their bytes copied over
    in one copy; the same for the residual as computed (the streamed request's scratch is on the device)."""

    checks_values = False  # the kernels do not look for NaN / Inf: stream_parts validates each part

    def __init__(self, fast: ModuleType, codec: KVCodec, params: LayoutParams) -> None:
        self.fast, self.codec, self.params = fast, codec, params

    def blocks_into(self, x: Tensor, kind: Kind, first_page: int, count: int, layer: int | None,
                    anchor: Tensor, residual: Tensor) -> None:
        tokens, heads, dim = (int(s) for s in x.shape)
        spans = block_spans(self.codec, tokens, heads, dim, kind)
        (a0, _), (r0, _) = spans[first_page]
        (_, a1), (_, r1) = spans[first_page + count - 1]
        with on_device(x.device):
            a_dev = anchor if anchor.device == x.device else torch.empty_like(anchor, device=x.device)
            r_dev = residual if residual.device == x.device else torch.empty_like(residual, device=x.device)
            self.fast.encode_pages_into(x, kind, first_page, count, a_dev, r_dev, params=self.params, layer=layer,
                                        codec_name=kernel_codec_name(self.codec.name))
            if a_dev is not anchor:
                anchor[a0:a1].copy_(a_dev[a0:a1])
            if r_dev is not residual:
                residual[r0:r1].copy_(r_dev[r0:r1])


def page_range_encoder(codec: KVCodec, config: LynxConfig, device: torch.device | str) -> PageEncoder | None:
    """The page-range encoder a prefill streams requests with (``prefill_stream``): on the CPU the C fast
    path where it applies, else the torch reference; on another device its kernel module's
    (:class:`KernelPageEncoder`), or None where no kernels serve it (the server then buffers each request
    and encodes it whole, with the reference on the CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        fast = _fast_module(codec, config, device)
        return KernelPageEncoder(fast, codec, _params(config)) if fast is not None else None
    if _fast_module(codec, config, device) is not None:
        try:
            return FastPageEncoder(codec, _params(config))
        except ImportError as exc:
            logger.warning("lynx: no C page-range encoder (%s); streaming prefill chunks with the reference", exc)
    return ReferencePageEncoder(codec)


def encode_request_streams(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], codec: KVCodec,
                           config: LynxConfig, reuse: PageReuse | None = None) -> tuple[Tensor, Tensor]:
    """(anchor, residual) uint8 streams of a whole request; with ``reuse``, full pages found in its cache
    (same prefix, same KV slots) are copied instead of encoded, and the others are stored there."""
    device = k_layers[0].device
    fast = _fast_module(codec, config, device)
    if fast is None and device.type != "cpu":  # the reference runs on the CPU (see REFERENCE_ON_THE_CPU)
        k_layers, v_layers, device = [x.cpu() for x in k_layers], [x.cpu() for x in v_layers], torch.device("cpu")
    if reuse is not None and (fast is None or device.type == "cpu"):
        # the encoded-page cache has a page-range encoder for the C path and the reference; on a GPU the
        # whole-layer Triton encode is faster than page-wise reference encoding of the misses
        return _encode_with_reuse(k_layers, v_layers, codec, config, reuse, fast is not None)
    if fast is None:
        payload = encode_request(k_layers, v_layers, codec)
        return payload.anchor, payload.residual
    return encode_with_kernels(fast, k_layers, v_layers, codec, config)


def encode_with_kernels(fast: ModuleType, k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], codec: KVCodec,
                        config: LynxConfig) -> tuple[Tensor, Tensor]:
    """(anchor, residual) streams of a request encoded by the kernel module ``fast`` where the KV is."""
    params = _params(config)
    anchors, residuals = [], []
    with on_device(k_layers[0].device):
        for kind, layers in (("k", k_layers), ("v", v_layers)):
            for layer, x in enumerate(layers):
                enc = fast.encode(x, kind, params=params, layer=layer, codec_name=kernel_codec_name(codec.name))
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
    device = k_pool[0].device
    fast = _fast_module(codec, config, device)
    if fast is None:  # the reference decodes on the CPU and copies into the pool (see REFERENCE_ON_THE_CPU)
        anchor, residual = anchor.cpu(), None if residual is None else residual.cpu()
        decode_request_into((anchor, residual), k_pool, v_pool, slots, with_residual=residual is not None,
                            codec=codec)
        return
    anchor, residual, slots = stage_on(device, anchor, residual, slots)
    decode_with_kernels(fast, anchor, residual, k_pool, v_pool, slots, codec, config)


def stage_on(device: torch.device, anchor: Tensor, residual: Tensor | None,
             slots: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """The staged streams and the slot ids on the pool's device: one blocking copy each (from pinned
    memory on a CUDA server: DMA at link speed), so the staging region may be released on return."""
    if anchor.device == device and slots.device == device and (residual is None or residual.device == device):
        return anchor, residual, slots
    return (anchor.to(device), None if residual is None else residual.to(device), slots.to(device))


def decode_with_kernels(fast: ModuleType, anchor: Tensor, residual: Tensor | None, k_pool: Sequence[Tensor],
                        v_pool: Sequence[Tensor], slots: Tensor, codec: KVCodec, config: LynxConfig) -> None:
    """Dequantize a request's streams into its pool slots with the kernel module ``fast`` (all tensors on
    the pool's device)."""
    heads, dim = int(k_pool[0].shape[1]), int(k_pool[0].shape[2])
    params = _params(config)
    with on_device(k_pool[0].device):
        for span in request_spans(codec, len(k_pool), int(slots.numel()), heads, dim):
            pool = (k_pool if span.kind == "k" else v_pool)[span.layer]
            a = anchor[span.anchor_offset: span.anchor_offset + span.anchor_bytes]
            r = None if residual is None else residual[span.residual_offset: span.residual_offset + span.residual_bytes]
            fast.decode_into(a, r, pool, slots, kind=span.kind, params=params)


# ----- lynx-exact's third stream -----
def exact_layer_codec() -> ModuleType:
    """The per-layer exact codec this process uses: the C fast path when it is built and gives the
    reference's bytes on a random layer (checked once), else the reference (``codec.lynx_exact``)."""
    from sglang_lynx.codec import lynx_exact

    key = ("lynx-exact", "exact-stream", "cpu")
    if _SELF_CHECKED.get(key) is False:
        return lynx_exact
    try:
        from sglang_lynx.codec.registry import get_codec
        from sglang_lynx.kernels import lynx_exact_cpu

        lynx_exact_cpu.library()
    except Exception as exc:  # not built (no compiler at set-up), no kernels package
        logger.warning("lynx: the lynx-exact C fast path is unavailable (%s); using the torch reference", exc)
        _SELF_CHECKED[key] = False
        return lynx_exact
    if key not in _SELF_CHECKED:
        codec = get_codec("lynx-exact")
        x = (torch.randn(37, 2, 64, generator=torch.Generator().manual_seed(2)) * 0.05).bfloat16()
        enc = codec.encode(x, "k")
        stream = lynx_exact.encode_exact(x, enc, codec.params)
        _SELF_CHECKED[key] = (lynx_exact_cpu.encode_exact(x, enc, codec.params) == stream
                              and torch.equal(lynx_exact_cpu.decode_exact(enc, stream, codec.params).view(torch.int16),
                                              x.view(torch.int16)))
        if not _SELF_CHECKED[key]:
            logger.warning("lynx: the lynx-exact C fast path disagrees with the reference; using the reference")
    return lynx_exact_cpu if _SELF_CHECKED[key] else lynx_exact


_piece_pools: dict[int, ThreadPoolExecutor] = {}
_piece_pools_lock = threading.Lock()


def exact_piece_runner(config: LynxConfig) -> exact_request.PieceRunner:
    """How this process codes the exact-stream pieces of one call: on the calling thread
    (``exact_threads`` 1), else on a pool of that many threads kept for the process (one per count), a
    call of one piece on the calling thread. Same bytes either way (``exact_request.PieceRunner``)."""
    threads = config.exact_thread_count()
    if threads <= 1:
        return exact_request.run_in_order
    with _piece_pools_lock:
        if threads not in _piece_pools:
            _piece_pools[threads] = ThreadPoolExecutor(threads, "lynx-exact-pieces")
        pool = _piece_pools[threads]

    def run(fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
        return [fn(job) for job in jobs] if len(jobs) <= 1 else list(pool.map(fn, jobs))

    return run


def exact_stream_writer(codec: KVCodec, layers: int, tokens: int, heads: int, dim: int,
                        out: Tensor, config: LynxConfig) -> exact_request.ExactRequestWriter:
    """A request's exact-stream writer (``codec.exact_request``) into ``out`` (uint8, its send region), on this
    process's exact codec and piece threads; it raises ``exact_request.ExactStreamTooLarge`` when a piece would
    not fit."""
    return exact_request.ExactRequestWriter(codec, layers, tokens, heads, dim, out, exact_layer_codec(),
                                            exact_piece_runner(config))


def encode_exact_stream(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], anchor: Tensor, residual: Tensor,
                        codec: KVCodec, out: Tensor, config: LynxConfig) -> int:
    """Encode a whole request's exact stream (one piece per layer K / V) into ``out`` and return its length;
    ``exact_request.ExactStreamTooLarge`` when it would not fit (the stream is then not sent)."""
    tokens, heads, dim = (int(n) for n in k_layers[0].shape)
    writer = exact_stream_writer(codec, len(k_layers), tokens, heads, dim, out, config)
    writer.write_whole(k_layers, v_layers, anchor.cpu(), residual.cpu())
    return writer.length


def decode_exact_streams(anchor: Tensor, residual: Tensor, exact: Tensor, k_pool: Sequence[Tensor],
                         v_pool: Sequence[Tensor], slots: Tensor, codec: KVCodec, config: LynxConfig) -> None:
    """Restore a request's BF16 KV bit for bit from its three streams into its pool slots."""
    exact_request.decode_exact_request_into(anchor.cpu(), residual.cpu(), exact.cpu().numpy().tobytes(), k_pool,
                                            v_pool, slots.to(torch.int64), codec=codec, impl=exact_layer_codec(),
                                            run_pieces=exact_piece_runner(config))
