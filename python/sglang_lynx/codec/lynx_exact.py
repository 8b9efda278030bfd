"""The ``lynx-exact`` stream: which BF16 value of its ``lynx`` bin each value is, entropy-coded with zstd.

Lifecycle. The prefill encodes a layer's K or V with ``lynx`` (anchor + residual), then
:func:`encode_exact` ``(x, enc)`` builds the layer's third stream from the original BF16 values; the
decode side, once anchor, residual and exact stream landed, calls :func:`decode_exact` ``(enc, exact)``
and gets the original BF16 tensor back, bit for bit. Both sides derive every value's bin from the
``lynx`` streams alone (``exact_bins``: first ordinal ``L`` and BF16 count ``n``); the stream carries
the rank ``ordinal(x) - L`` of each value whose bin holds more than one BF16 value.

What is exact without the stream: the first ``min(sink_tokens, T)`` tokens (the layer header holds
their BF16 bits) and every value whose bin holds one BF16 value (``n == 1``: ~14 % on the default
model). The recent tokens (the anchor's trailer) carry 8-bit codes, not BF16, so they are coded like
every other token. Inputs must be BF16 (a BF16 KV pool; ``lynx-exact`` refuses other pools at start-up)
and finite: NaN / Inf are rejected by the ``lynx`` encoder as today. ±0, subnormals and constant
groups are ordinary BF16 values here (a constant group's bin is its one value, or ``-0`` / ``+0``).

Layout of one layer's exact stream (little-endian)::

    "LXE1"                        4 bytes
    escapes                       u32: values stored verbatim (outside their computed bin)
    frame_bytes[NUM_FRAMES]       u32 each: the zstd frames below (0: the class is empty)
    escape_index[escapes]         u32 each: flat index into [T][H][D], ascending
    escape_bits[escapes]          u16 each: the BF16 bit pattern
    frames                        one zstd frame per entry of FRAMES, in order

``FRAMES`` splits the ranks by the bin's count ``n`` (:data:`RANK_CLASSES`): each class packs its ranks
into ``bits`` bits (low bits first, LSB-first inside a byte, zero padded) in value order, and classes
of 16-bit ranks go as two byte planes (low, high) so zstd's Huffman / FSE stages see each with its
own statistics. There is no hand-written entropy coder: the bytes are plain zstd frames
(``zstandard``; level :data:`ZSTD_LEVEL`, which the decoder does not need).
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import EncodedKV
from .exact_bins import bf16_ordinals, bins, from_ordinal, value_fields
from .layout import LayoutParams, stream_bytes, trailer_bytes

MAGIC = b"LXE1"
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class RankClass:
    """Ranks of values whose bin holds ``lo..hi`` BF16 values, packed into ``bits`` bits each."""

    lo: int
    hi: int
    bits: int


RANK_CLASSES: tuple[RankClass, ...] = (
    RankClass(2, 2, 1),
    RankClass(3, 3, 2),
    RankClass(4, 4, 2),
    RankClass(5, 8, 4),
    RankClass(9, 16, 4),
    RankClass(17, 64, 8),
    RankClass(65, 256, 8),
    RankClass(257, 1 << 16, 16),
)
#: (class index, byte plane) of each frame: 16-bit classes take two frames (low byte, high byte).
FRAMES: tuple[tuple[int, int], ...] = tuple(
    (i, plane) for i, c in enumerate(RANK_CLASSES) for plane in range(2 if c.bits == 16 else 1)
)
NUM_FRAMES = len(FRAMES)
#: The frames of each rank class, in order (parse_stream groups the planes by it).
CLASS_FRAMES: tuple[tuple[int, ...], ...] = tuple(
    tuple(f for f, (k, _) in enumerate(FRAMES) if k == i) for i in range(len(RANK_CLASSES))
)
HEADER = struct.Struct(f"<4sI{NUM_FRAMES}I")


class ExactStreamError(ValueError):
    """An exact stream does not fit the ``lynx`` streams it is decoded against (corrupt or foreign)."""


#: The lynx encoder never writes a NaN or Inf group statistic (it refuses |KV| > 32000), so one means a corrupt
#: anchor: every implementation refuses it rather than derive bins from it.
NOT_FINITE = "a group's mn or rng in the lynx anchor is NaN or Inf (a corrupt anchor)"


def blocks_bytes(tokens: int, heads: int, dim: int, kind: str, params: LayoutParams) -> tuple[int, int]:
    """(anchor, residual) bytes of a ``lynx`` layer the exact stream reads: the header and the page blocks,
    not the trailer (so a run of pages can be coded alone, ``exact_request``)."""
    anchor, residual = stream_bytes("lynx", tokens, heads, dim, kind, params)  # type: ignore[arg-type]
    return anchor - trailer_bytes("lynx", tokens, heads, dim, params), residual


@functools.lru_cache(maxsize=512)
def _lynx_sizes(blocks: bool, tokens: int, heads: int, dim: int, kind: str, params: LayoutParams) -> tuple[int, int]:
    """(anchor, residual) bytes :func:`check_lynx` expects (cached: the layout walk costs more than a small layer's
    exact-stream pass)."""
    if blocks:
        return blocks_bytes(tokens, heads, dim, kind, params)
    return stream_bytes("lynx", tokens, heads, dim, kind, params)  # type: ignore[arg-type]


def check_lynx(enc: EncodedKV, params: LayoutParams, *, blocks: bool = False) -> None:
    """``enc`` is a whole ``lynx`` encoding (anchor and residual) of the layout ``params``; ``blocks``: its
    header and page blocks only (:func:`blocks_bytes`: a run of pages cut out of a layer's streams)."""
    if enc.codec not in ("lynx", "lynx-int8", "lynx-exact"):
        raise ValueError(f"the exact stream refines the lynx codec, got an encoding of {enc.codec!r}")
    want = _lynx_sizes(blocks, enc.num_tokens, enc.num_heads, enc.head_dim, enc.kind, params)
    if (enc.anchor.numel(), enc.residual.numel()) != want:
        raise ValueError(
            f"lynx {enc.kind}: streams of {enc.anchor.numel()} + {enc.residual.numel()} bytes, expected {want} "
            "(the exact stream needs the anchor and the whole residual)"
        )


def _layer_bins(enc: EncodedKV, params: LayoutParams) -> tuple[Tensor, Tensor, int]:
    """Flat (L, n) of every value and the count of leading values the layer header restores."""
    fields = value_fields(enc.anchor, enc.residual, enc.num_tokens, enc.num_heads, enc.head_dim, enc.kind, params)
    if not (bool(fields[0].isfinite().all()) and bool(fields[1].isfinite().all())):
        raise ExactStreamError(NOT_FINITE)
    first, count = bins(fields[2], fields[0], fields[1])
    sink_values = min(params.sink_tokens, enc.num_tokens) * enc.num_heads * enc.head_dim
    return first.reshape(-1), count.reshape(-1), sink_values


def _class_masks(count: Tensor, coded: Tensor) -> list[Tensor]:
    return [coded & (count >= c.lo) & (count <= c.hi) for c in RANK_CLASSES]


def _pack(ranks: Tensor, bits: int) -> list[bytes]:
    """int32 ranks -> the class's byte planes (one for bits <= 8, two for 16)."""
    if bits == 16:
        return [(ranks & 0xFF).to(torch.uint8).numpy().tobytes(), (ranks >> 8).to(torch.uint8).numpy().tobytes()]
    per = 8 // bits
    pad = -ranks.numel() % per
    codes = torch.cat([ranks, ranks.new_zeros(pad)]).view(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    return [(codes << shifts).sum(dim=1).to(torch.uint8).numpy().tobytes()]


def _unpack(planes: list[bytes], bits: int, count: int) -> Tensor:
    """Inverse of :func:`_pack`: ``count`` int32 ranks."""
    arrays = [_buffer(p, torch.uint8).to(torch.int32) for p in planes]
    if bits == 16:
        return arrays[0] | (arrays[1] << 8)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32)
    return ((arrays[0].unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


def _buffer(data: bytes, dtype: torch.dtype) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def plane_bytes(bits: int, count: int) -> int:
    """Bytes of one plane holding ``count`` ranks of ``bits`` bits."""
    return count if bits >= 8 else -(-count * bits // 8)


def check_exact_input(x: Tensor, enc: EncodedKV, params: LayoutParams, *, finite: bool = True,
                      blocks: bool = False) -> None:
    """``x`` is (``finite``: finite) BF16 of ``enc``'s shape and ``enc`` a whole ``lynx`` encoding
    (``blocks``: its header and page blocks, :func:`check_lynx`)."""
    if not isinstance(x, Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"the exact stream restores BF16 values; got {getattr(x, 'dtype', type(x).__name__)} "
                        "(lynx-exact needs a bf16 KV pool)")  # fmt: skip
    if tuple(x.shape) != (enc.num_tokens, enc.num_heads, enc.head_dim):
        raise ValueError(f"x has shape {tuple(x.shape)}, the encoding {(enc.num_tokens, enc.num_heads, enc.head_dim)}")
    check_lynx(enc, params, blocks=blocks)
    if finite and not bool(torch.isfinite(x).all()):
        raise ValueError("NaN or Inf in the KV: the lynx codecs take finite KV caches only")


_contexts = threading.local()  # zstd contexts are not thread-safe: one set per thread


def _zstd_context(key: tuple[str, int]) -> Any:
    """This thread's zstd compressor of a level, or its decompressor (made once: ~10 us each, as much as a small
    layer's frames). A context reused gives the same bytes as a new one (each frame is compressed whole)."""
    import zstandard  # here, not at the top: a bare CUDA machine (scripts/gpu_check.sh) has no zstandard

    cache = _contexts.__dict__.setdefault("by_key", {})
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=key[1]) if key[0] == "compressor" else zstandard.ZstdDecompressor()
    return cache[key]


#: Planes (or frames) of fewer bytes in all are (de)compressed on the calling thread alone, whatever ``workers``.
PARALLEL_MIN_BYTES = 128 << 10  # measured: ~70 KiB (a 1K-token layer) gains 10%, 280 KiB 38%
_pool_lock = threading.Lock()
_pools: dict[int, Any] = {}


def _on_workers(jobs: Sequence[Any], sizes: Sequence[int], workers: int, run: Any) -> list[Any]:
    """``[run(job) for job in jobs]``, the jobs split by size over ``workers`` threads (the calling one and
    ``workers - 1`` pooled ones; zstandard releases the GIL while it works)."""
    if workers <= 1 or len(jobs) < 2 or sum(sizes) < PARALLEL_MIN_BYTES:
        return [run(job) for job in jobs]
    from concurrent.futures import ThreadPoolExecutor

    groups: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in sorted(range(len(jobs)), key=lambda i: -sizes[i]):  # largest first, onto the lightest group
        g = loads.index(min(loads))
        groups[g].append(i)
        loads[g] += sizes[i]
    with _pool_lock:
        pool = _pools.get(workers) or _pools.setdefault(workers, ThreadPoolExecutor(workers - 1, "lynx-exact-zstd"))
    futures = [pool.submit(lambda group=group: [run(jobs[i]) for i in group]) for group in groups[1:] if group]
    out: list[Any] = [None] * len(jobs)
    for i, result in zip(groups[0], [run(jobs[i]) for i in groups[0]], strict=True):
        out[i] = result
    for group, future in zip([g for g in groups[1:] if g], futures, strict=True):
        for i, result in zip(group, future.result(), strict=True):
            out[i] = result
    return out


def frame_stream(escape_index: bytes, escape_bits: bytes, class_planes: Sequence[Sequence[bytes | memoryview]],
                 level: int, workers: int = 1) -> bytes:
    """The layer stream from its escapes (u32 indices, u16 bits, as bytes) and each rank class's planes
    (``[]`` for an empty class; bytes or any contiguous buffer). ``workers``: threads that compress the frames
    (each frame whole on one thread: the same bytes)."""
    planes = [p for class_planes_k in class_planes for p in class_planes_k]
    sizes = [len(memoryview(p)) for p in planes]
    if workers <= 1 or len(planes) < 2 or sum(sizes) < PARALLEL_MIN_BYTES:  # on this thread (as _on_workers)
        context = _zstd_context(("compressor", level))
        compressed = iter([context.compress(p) for p in planes])
    else:
        compressed = iter(_on_workers(planes, sizes, workers,
                                      lambda p: _zstd_context(("compressor", level)).compress(p)))  # fmt: skip
    frames: list[bytes] = []
    for rank_class, planes_k in zip(RANK_CLASSES, class_planes, strict=True):
        frames += [next(compressed) for _ in planes_k] or [b""] * (2 if rank_class.bits == 16 else 1)
    escapes = len(escape_index) // 4
    return b"".join([HEADER.pack(MAGIC, escapes, *(len(f) for f in frames)), escape_index, escape_bits, *frames])


def parse_stream(data: bytes, values: int, workers: int = 1) -> tuple[bytes, bytes, list[list[bytes]]]:
    """Inverse of :func:`frame_stream` for a layer of ``values`` values (planes decompressed; an empty frame
    gives ``b""``). A frame must declare its size, at most ``values`` bytes (no plane holds more), so a
    corrupt header cannot make the decoder allocate more than the layer. ``workers``: threads that decompress
    the frames (the first bad frame in order raises, as with one)."""
    if len(data) < HEADER.size:
        raise ExactStreamError(f"exact stream of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
    magic, escapes, *frame_bytes = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ExactStreamError(f"not a lynx-exact layer stream (magic {magic!r})")
    if len(data) != HEADER.size + 6 * escapes + sum(frame_bytes):
        raise ExactStreamError(f"exact stream has {len(data)} bytes, its header says "
                               f"{HEADER.size + 6 * escapes + sum(frame_bytes)}")  # fmt: skip
    import zstandard

    view, offset = memoryview(data), HEADER.size + 6 * escapes  # frames decompressed in place, not copied out
    index_end = HEADER.size + 4 * escapes
    if workers <= 1 or sum(frame_bytes) < PARALLEL_MIN_BYTES:  # frame by frame on this thread (as _on_workers)
        context, planes = _zstd_context(("decompressor", 0)), []
        for size in frame_bytes:
            frame = view[offset : offset + size]
            offset += size
            if not size:
                planes.append(b"")
                continue
            try:
                declared = zstandard.frame_content_size(frame)
                if declared < 0 or declared > values:
                    raise ExactStreamError(f"a zstd frame of the exact stream declares {declared} bytes "
                                           f"(at most {values})")  # fmt: skip
                planes.append(context.decompress(frame))
            except zstandard.ZstdError as exc:
                raise ExactStreamError(f"a zstd frame of the exact stream is corrupt: {exc}") from None
        return (data[HEADER.size : index_end], data[index_end : index_end + 2 * escapes],
                [[planes[f] for f in class_frames] for class_frames in CLASS_FRAMES])  # fmt: skip
    checked: list[Any] = []  # per frame: its view, once its declared size passed, else the error
    for size in frame_bytes:
        frame = view[offset : offset + size]
        offset += size
        try:
            declared = zstandard.frame_content_size(frame) if size else 0
            if declared < 0 or declared > values:
                checked.append(ExactStreamError(f"a zstd frame of the exact stream declares {declared} bytes "
                                                f"(at most {values})"))  # fmt: skip
            else:
                checked.append(frame)
        except zstandard.ZstdError as exc:
            checked.append(ExactStreamError(f"a zstd frame of the exact stream is corrupt: {exc}"))

    def decompress(item: Any) -> Any:
        if isinstance(item, ExactStreamError):
            return item
        if not len(item):
            return b""
        try:
            return _zstd_context(("decompressor", 0)).decompress(item)
        except zstandard.ZstdError as exc:
            return ExactStreamError(f"a zstd frame of the exact stream is corrupt: {exc}")

    frames = _on_workers(checked, [0 if isinstance(c, ExactStreamError) else len(c) for c in checked], workers,
                         decompress)  # fmt: skip
    for frame in frames:  # the first bad frame in order, as a frame-by-frame pass would find it
        if isinstance(frame, ExactStreamError):
            raise frame
    class_planes = [[frames[f] for f in class_frames] for class_frames in CLASS_FRAMES]
    return data[HEADER.size : index_end], data[index_end : index_end + 2 * escapes], class_planes


def encode_exact(x: Tensor, enc: EncodedKV, params: LayoutParams | None = None, *, level: int = ZSTD_LEVEL,
                 blocks: bool = False) -> bytes:
    """The exact stream of one layer's BF16 ``x[T, H, D]`` against its ``lynx`` encoding ``enc``
    (``blocks``: ``enc`` holds only the header and page blocks, :func:`check_lynx`: the same bytes)."""
    params = params or LayoutParams()
    check_exact_input(x, enc, params, blocks=blocks)
    first, count, sink_values = _layer_bins(enc, params)
    rank = bf16_ordinals(x.cpu()).reshape(-1) - first
    active = torch.ones_like(count, dtype=torch.bool)
    active[:sink_values] = False
    escaped = active & ((rank < 0) | (rank >= count))
    coded = active & ~escaped & (count >= 2)
    class_planes = [
        _pack(rank[mask], rank_class.bits) if bool(mask.any()) else []
        for rank_class, mask in zip(RANK_CLASSES, _class_masks(count, coded), strict=True)
    ]
    index = escaped.nonzero().reshape(-1)
    escape_bits = x.cpu().contiguous().view(torch.int16).reshape(-1)[index]
    return frame_stream(index.to(torch.int32).numpy().astype("<u4").tobytes(),
                        escape_bits.numpy().astype("<u2").tobytes(), class_planes, level)  # fmt: skip


def decode_exact(enc: EncodedKV, exact: bytes | bytearray | memoryview, params: LayoutParams | None = None, *,
                 blocks: bool = False) -> Tensor:
    """The original BF16 ``[T, H, D]`` from a layer's ``lynx`` streams and its exact stream (``blocks``: as
    for :func:`encode_exact`)."""
    params = params or LayoutParams()
    check_lynx(enc, params, blocks=blocks)
    index_bytes, bits_bytes, class_planes = parse_stream(bytes(exact), enc.num_tokens * enc.num_heads * enc.head_dim)
    first, count, sink_values = _layer_bins(enc, params)
    index = _buffer(index_bytes, torch.int32).to(torch.int64)
    escape_bits = _buffer(bits_bytes, torch.int16)
    if index.numel() and (int(index.min()) < sink_values or int(index.max()) >= count.numel()
                          or bool((index[1:] <= index[:-1]).any())):  # fmt: skip
        raise ExactStreamError("exact stream escapes a value outside the layer (or out of order)")
    active = torch.ones_like(count, dtype=torch.bool)
    active[:sink_values] = False
    active[index] = False
    if bool((active & (count < 1)).any()):
        raise ExactStreamError("exact stream leaves a value of an empty bin unescaped")
    ords = first.clone()
    masks = _class_masks(count, active & (count >= 2))
    for rank_class, mask, planes in zip(RANK_CLASSES, masks, class_planes, strict=True):
        values = int(mask.sum())
        for plane in planes:
            if len(plane) != plane_bytes(rank_class.bits, values):
                raise ExactStreamError(f"rank class {rank_class} holds {len(plane)} bytes for {values} values")
        if values:
            rank = _unpack(planes, rank_class.bits, values)
            if bool((rank >= count[mask]).any()):
                raise ExactStreamError(f"a rank of class {rank_class} lies outside its bin")
            ords[mask] += rank
    bits = from_ordinal(ords)
    bits[index] = escape_bits
    bits[:sink_values] = enc.anchor[: 2 * sink_values].cpu().contiguous().view(torch.int16)
    return bits.view(torch.bfloat16).view(enc.num_tokens, enc.num_heads, enc.head_dim)
