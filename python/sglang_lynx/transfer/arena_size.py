"""How big a Lynx staging arena is: from the model, the mode and the server's KV pool (pure).

Each server registers one arena at start-up, when SGLang has built its KV pool (``attach_pool``): the
prefill's *send* arena (``LynxConfig.send_arena_mb``) holds a request's encoded streams until the
decode has them; the decode's *receive* arena (``LynxConfig.receive_arena_mb``) holds them until they
are dequantized into the decode pool. A request's footprint is what the staging allocator reserves
for it: the mode's anchor and residual stream bytes for its token count (``codec/layout.py``, i.e.
layers x KV heads x head_dim x bits per value, plus metadata), each rounded up to the allocator's
alignment.

- ``"auto"`` (the default): the footprint of the whole KV pool (``pool_tokens``), so every request the
  server can hold in flight fits at once, capped at ``arena_cap_mb``; rounded up to whole MiB.
- an explicit size in MiB: used as given.

Either way the arena must hold the footprint of one max-context request (``max_request_tokens``:
the server's longest request, at most its pool); if it cannot, start-up is refused with a
:class:`~sglang_lynx.config.LynxConfigError` naming the field to change. A request that does not fit
the free space at run time waits its turn (``StagingAllocator``, FIFO); one larger than the whole
arena fails at once, with the same field named (:func:`too_large_message`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_lynx.config import AUTO, LynxConfig, LynxConfigError

MIB = 1 << 20
#: which config field sizes each arena
FIELDS = {"send": "send_arena_mb", "receive": "receive_arena_mb"}


@dataclass(frozen=True)
class ArenaSize:
    field: str  # the LynxConfig field that set it
    arena_bytes: int
    auto: bool
    pool_bytes: int  # footprint of the whole KV pool (what "auto" asks for before the cap)
    max_request_bytes: int  # footprint of one max-context request (the floor)

    def describe(self) -> str:
        how = "auto" if self.auto else "explicit"
        return (f"{self.field}={self.arena_bytes / MIB:.0f} MiB ({how}; the KV pool's streams: "
                f"{self.pool_bytes / MIB:.1f} MiB, one max-context request: {self.max_request_bytes / MIB:.1f} MiB)")


def size_arena(config: LynxConfig, side: str, footprint: Callable[[int], int], pool_tokens: int,
               max_request_tokens: int) -> ArenaSize:
    """The arena of ``side`` ("send" or "receive"); ``footprint(tokens)`` is the staging bytes of one
    request of that many tokens. Raises :class:`LynxConfigError` naming the field when it cannot work."""
    field = FIELDS[side]
    if pool_tokens < 1 or max_request_tokens < 1:
        raise ValueError(f"pool_tokens {pool_tokens} and max_request_tokens {max_request_tokens} must be >= 1")
    max_request_tokens = min(max_request_tokens, pool_tokens)
    setting = getattr(config, field)
    pool_bytes, one = footprint(pool_tokens), footprint(max_request_tokens)
    floor_mb = -(-one // MIB)
    if setting == AUTO:
        cap = config.arena_cap_mb * MIB
        size = min(-(-pool_bytes // MIB) * MIB, cap)
        if size < one:
            raise LynxConfigError(
                f"{field}: \"auto\" is capped at arena_cap_mb={config.arena_cap_mb} MiB, which cannot hold one "
                f"max-context request ({max_request_tokens} tokens need {floor_mb} MiB of {side} staging in mode "
                f"{config.mode}): raise arena_cap_mb to at least {floor_mb}, or lower --context-length")
        return ArenaSize(field, size, True, pool_bytes, one)
    size = int(setting) * MIB
    if size < one:
        raise LynxConfigError(
            f"{field}: {setting} MiB cannot hold one max-context request ({max_request_tokens} tokens need "
            f"{floor_mb} MiB of {side} staging in mode {config.mode}): set it to at least {floor_mb}, "
            f"or \"auto\", or lower --context-length")
    return ArenaSize(field, size, False, pool_bytes, one)


def too_large_message(field: str, request_id: str, need: int, arena_bytes: int) -> str:
    """The error of a request that can never fit its arena (bigger than the whole of it)."""
    return (f"request {request_id!r} needs {need} bytes of staging, more than the whole arena "
            f"({arena_bytes} bytes): raise LynxConfig.{field} (or use \"auto\") so that a max-context request fits")
