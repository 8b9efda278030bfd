"""The staging arena of one Lynx server, built when SGLang hands over its KV pool.

``LynxPrefillSide`` / ``LynxDecodeSide`` are constructed with SGLang's KV manager, before the KV pool
tensors exist; ``attach_pool`` (AFTER ``*._init_kv_manager``) then calls :func:`build_arena` with the
pool and the scheduler's limits: the arena is sized from the model's KV shape, the mode's stream
layout and the pool (``transfer/arena_size.py``; a size that cannot work refuses start-up with the
config field named), allocated, registered with the Mooncake engine, and given a FIFO staging
allocator that names the same field in its errors. On a CUDA server the arena is pinned host memory
(:func:`pinned_staging`): the prefill's encoded streams are copied into it from the GPU, the decode's
are copied from it to the GPU, both by DMA; registering GPU memory with Mooncake instead (GPUDirect
RDMA straight into device staging) is not built. :func:`stream_sizes` is the one place both sides
compute a request's stream sizes from its token count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.codec.base import KVCodec
from sglang_lynx.codec.exact_request import exact_request_capacity
from sglang_lynx.codec.request import request_stream_bytes
from sglang_lynx.codec.wire_residual import residual_wire_bytes
from sglang_lynx.config import LynxConfig
from sglang_lynx.transfer.arena_size import ArenaSize, size_arena
from sglang_lynx.transfer.staging import StagingAllocator, footprint
from sglang_lynx.transfer.streams import StreamKind

logger = logging.getLogger("sglang_lynx.transport")


@dataclass(frozen=True)
class KVShape:
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, k_pool: list[torch.Tensor]) -> KVShape:
        return cls(len(k_pool), int(k_pool[0].shape[1]), int(k_pool[0].shape[2]))


def stream_sizes(codec: KVCodec, shape: KVShape, tokens: int) -> dict[StreamKind, int]:
    """The stream sizes of one request of ``tokens`` tokens on the wire (the residual only where the mode
    sends one, less what the anchor's trailer carries: ``codec.wire_residual``; the exact stream's capacity
    in ``lynx-exact``: its bytes depend on the values, ``codec.exact_request``)."""
    anchor, residual = request_stream_bytes(codec, shape.layers, tokens, shape.heads, shape.head_dim)
    sizes = {StreamKind.ANCHOR: anchor}
    if codec.two_streams and residual > 0:
        sizes[StreamKind.RESIDUAL] = residual_wire_bytes(codec, shape.layers, tokens, shape.heads, shape.head_dim)
        if getattr(codec, "exact_stream", False):
            sizes[StreamKind.EXACT] = exact_request_capacity(shape.layers, tokens, shape.heads, shape.head_dim,
                                                               codec.params.page_tokens)
    return sizes


@dataclass
class Arena:
    memory: torch.Tensor  # uint8, registered with the engine
    allocator: StagingAllocator
    size: ArenaSize

    @property
    def addr(self) -> int:
        return int(self.memory.data_ptr())


def build_arena(config: LynxConfig, side: str, codec: KVCodec, engine: Any, k_pool: list[torch.Tensor],
                pool_tokens: int, max_request_tokens: int) -> Arena:
    """Size (or refuse: LynxConfigError naming the field), allocate and register the arena of ``side``."""
    shape = KVShape.of_pool(k_pool)
    size = size_arena(config, side, lambda n: footprint(stream_sizes(codec, shape, n)), pool_tokens,
                      max_request_tokens)
    memory = torch.empty(size.arena_bytes, dtype=torch.uint8, pin_memory=pinned_staging(k_pool[0].device))
    engine.register(memory.data_ptr(), size.arena_bytes)
    allocator = StagingAllocator(memory.data_ptr(), size.arena_bytes, size_field=size.field)
    logger.info("sglang-lynx: %s arena %s; KV %d layers x %d heads x %d dims, pool %d tokens, max request "
                "%d tokens", side, size.describe(), shape.layers, shape.heads, shape.head_dim, pool_tokens,
                max_request_tokens)
    return Arena(memory, allocator, size)


def pinned_staging(pool_device: torch.device) -> bool:
    """Whether the arena is page-locked host memory: on a CUDA server (the codec copies between it and the
    GPU by DMA, ``transport.codec``); plain host memory elsewhere."""
    return pool_device.type == "cuda" and torch.cuda.is_available()


def scheduler_limits(queue: Any, k_pool: list[torch.Tensor]) -> tuple[int, int]:
    """(KV pool tokens, longest request in tokens) of the SGLang scheduler that owns ``queue``."""
    scheduler = getattr(queue, "scheduler", None)
    pool_tokens = int(getattr(scheduler, "max_total_num_tokens", 0) or int(k_pool[0].shape[0]))
    max_request = int(getattr(scheduler, "max_req_len", 0) or pool_tokens)
    return pool_tokens, min(max_request, pool_tokens)
