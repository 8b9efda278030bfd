"""The SGLang hooks of layer groups (``prefill_layers`` tells the lifecycle), registered only when
``LynxConfig.stream_layer_group > 0``.

- ``Scheduler.run_batch`` (around), on a prefill server: before the forward, each request's chunk in
  the batch (bootstrap room, first token, KV slots from ``req_to_token``) goes to
  :meth:`~.prefill_layers.LayerGroups.begin_forward`; the layered ones are watched through an attribute
  on the KV pool object until the forward returns (or raises), then ``end_forward``.
- ``MHATokenToKVPool.set_kv_buffer`` (after): the write of a layer that ends a group hands the group over
  (``layers_written``). Nothing happens on a pool no forward is watched on (decode servers, other batches).

Neither hook may break SGLang's forward: an error of the Lynx side is logged and stops the watch; the
chunks it did not copy are then refused by their ``send_kvcache`` (one request fails, not the server).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_lynx.integration.hook_targets import register
from sglang_lynx.integration.transport.prefill_layers import ChunkInForward, LayerForward, LayerGroups

logger = logging.getLogger("sglang_lynx.transport")

WATCH_ATTR = "lynx_layer_forward"  # on SGLang's KV pool object while a watched forward runs


class _Watch:
    def __init__(self, side: LayerGroups, forward: LayerForward) -> None:
        self.side, self.forward, self.ends = side, forward, side.layer_group_ends()


def _chunks_of(scheduler: Any, batch: Any) -> list[ChunkInForward]:
    """The batch's chunks (extend batches only): room, first token, KV slot of each token."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend() or not batch.prefix_lens or not batch.extend_lens:
        return []
    req_to_token = scheduler.req_to_token_pool.req_to_token
    chunks = []
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
        room = getattr(req, "bootstrap_room", None)
        if room is None or extend <= 0:
            continue
        row = req_to_token[req.kv.req_pool_idx]
        slots = row[prefix : prefix + extend].to(torch.int64)
        chunks.append(ChunkInForward(int(room), int(prefix), slots, row[:prefix].to(torch.int64)))
    return chunks


def _begin(scheduler: Any, batch: Any) -> tuple[Any, _Watch] | None:
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    manager = getattr(queue, "kv_manager", None)
    side = getattr(manager, "lynx", None)
    if queue is None or not isinstance(side, LayerGroups) or batch is None:
        return None
    chunks = _chunks_of(scheduler, batch)
    forward = side.begin_forward(manager, chunks) if chunks else None
    if forward is None:
        return None
    pool = queue.token_to_kv_pool
    return getattr(pool, "full_kv_pool", pool), _Watch(side, forward)


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        watched = _begin(scheduler, batch)
    except Exception:  # never break the forward: the chunks go as before (their send_kvcache decides)
        logger.exception("lynx: layer groups could not follow this forward")
        watched = None
    if watched is None:
        return original(scheduler, batch, *args, **kwargs)
    pool, watch = watched
    setattr(pool, WATCH_ATTR, watch)
    completed = False
    try:
        result = original(scheduler, batch, *args, **kwargs)
        completed = True
        return result
    finally:
        setattr(pool, WATCH_ATTR, None)
        try:
            watch.side.end_forward(watch.forward, completed)
        except Exception:
            logger.exception("lynx: layer groups: the end of a forward failed (its chunks will be refused)")


def _after_set_kv_buffer(result: Any, pool: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    watch = getattr(pool, WATCH_ATTR, None)
    if watch is None or watch.forward.ended:
        return result
    layer_id = kwargs.get("layer_id_override")
    if layer_id is None:
        layer_id = getattr(layer, "layer_id", None)
    if layer_id is None or int(layer_id) + 1 not in watch.ends:
        return result
    try:
        watch.side.layers_written(watch.forward, int(layer_id) + 1)
    except Exception:
        logger.exception("lynx: layer groups: handing over layers up to %s failed (its chunks will be refused)",
                         layer_id)
        watch.forward.ended = True
    return result


def install_layer_hooks() -> None:
    register("sglang.srt.managers.scheduler.Scheduler.run_batch", _around_run_batch, "around")
    register("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer", _after_set_kv_buffer, "after")
