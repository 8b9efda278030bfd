"""The Lynx state of one decode server: a :class:`DecodeLynxState` per SGLang decode scheduler.

Lifecycle: the first ``get_next_disagg_decode_batch_to_run`` hook that runs on a scheduler instance
creates its state (:func:`state_for`) and stores it on the scheduler itself (``scheduler._lynx``);
the state lives and dies with that scheduler. Every request the state tracks carries a
back-reference to it (``req._lynx``), so the hooks that see only a request (the streamer's
``accept``, ``Req.update_finish_state``, ``Req.init_next_round_input``) find the state of the
scheduler that tracks it, and the sampler hook gets it from the ``run_batch`` call it runs in
(``decode.sampling``). A hook on a scheduler without a state (a prefill server, a decode scheduler
before its first batch) does nothing. Nothing per request or per server is module-level: two
decode schedulers in one process (tests) never see each other's requests, even under one rid.

Invariants (per state):

- ``tracked``: rid -> :class:`~sglang_lynx.integration.decode.tracked.Tracked` for every Lynx
  request admitted on its anchor and not done yet (removed when it finishes, aborts or fails).
- ``parked`` is a subset of ``tracked`` (same objects): the requests out of the running batch that
  wait for their residual, verify, fallback or failure; each owns a KV row until it is re-admitted.
- ``readmitted``: rid -> (prefix_len, cache_protected_len) saved when a parked request goes back to
  ``waiting_queue``; popped by that request's next ``init_next_round_input``.
- ``laws`` (``decode.sampling.DraftLaws``): draft-law records of tracked sampling requests only
  (``retain`` before every batch drops any other).
- ``counts``: this server's totals (``decode.metrics.ServerCounts``); ``gemm``: its verify GEMM
  policy (one object, so its call counts add up); ``attention``: its chain attention kernel
  (``decode.attention_kernel``; None with ``verify_attention = "per-input"``); ``config`` and ``side`` (the decode-side
  transport, ``LynxDecodeSide``) are the scheduler's, fixed for its life.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import Phase
from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
from sglang_lynx.integration.decode.metrics import ServerCounts
from sglang_lynx.integration.decode.row_gemm import RowGemmPolicy
from sglang_lynx.integration.decode.sampling import DraftLaws
from sglang_lynx.integration.decode.tracked import STATE_ATTR, Tracked

logger = logging.getLogger("sglang_lynx.decode")


@dataclass
class DecodeLynxState:
    scheduler: Any
    side: Any  # the scheduler's LynxDecodeSide: forget / abort a bootstrap room, inbound progress
    config: LynxConfig
    tracked: dict[str, Tracked] = field(default_factory=dict)
    parked: dict[str, Tracked] = field(default_factory=dict)
    readmitted: dict[str, tuple[int, int]] = field(default_factory=dict)
    laws: DraftLaws = field(default_factory=DraftLaws)
    counts: ServerCounts = field(default_factory=ServerCounts)
    gemm: RowGemmPolicy = field(init=False)
    attention: ChainAttentionKernel | None = field(init=False)

    def __post_init__(self) -> None:
        self.gemm = RowGemmPolicy(self.config.verify_gemm)
        self.attention = ChainAttentionKernel() if self.config.verify_attention == "kernel" else None
        if self.attention is not None:  # its self-check (~1 s), before any verify
            self.attention.prepare()
        runner = getattr(getattr(self.scheduler, "tp_worker", None), "model_runner", None)
        if self.gemm.kernel is not None and runner is not None:  # the verify's row kernel, before any verify
            try:
                self.gemm.kernel.prepare(runner.model)
            except Exception:  # weights it did not admit are admitted (or refused) on their first use
                logger.exception("lynx: preparing the verify's row GEMMs failed; they are set up on first use")

    def track(self, tracked: Tracked) -> None:
        self.tracked[tracked.req.rid] = tracked
        setattr(tracked.req, STATE_ATTR, self)

    def done(self, t: Tracked, residual_may_land: bool = False) -> None:
        """``t``'s request ended (any reason): drop it and release (or abort) its Lynx transfer."""
        self.tracked.pop(t.req.rid, None)
        self.parked.pop(t.req.rid, None)
        self.laws.forget(t.req.rid)
        try:
            if t.state.phase is Phase.NORMAL and not residual_may_land:
                self.side.forget(t.room)
            else:
                self.side.abort(t.room, f"request finished in phase {t.state.phase.name}")
        except Exception:  # the request is done either way; the transport's own sweep reclaims it
            logger.exception("lynx: %s: releasing the Lynx transfer at the finish raised", t.req.rid)


def lynx_side_of(scheduler: Any) -> Any:
    return scheduler.disagg_decode_prealloc_queue.kv_manager.lynx


def state_for(scheduler: Any) -> DecodeLynxState:
    """``scheduler``'s state, created on the first call with its Lynx side's config."""
    state = getattr(scheduler, STATE_ATTR, None)
    if state is None:
        side = lynx_side_of(scheduler)
        config = getattr(side, "config", None)
        if not isinstance(config, LynxConfig):
            raise RuntimeError(f"sglang-lynx: the decode scheduler's Lynx side ({type(side).__name__}) "
                               "carries no LynxConfig")
        state = DecodeLynxState(scheduler, side, config)
        setattr(scheduler, STATE_ATTR, state)
    return state  # type: ignore[no-any-return]


def state_of(obj: Any) -> DecodeLynxState | None:
    """The state a scheduler owns or a request is tracked by, or None (never creates one)."""
    state = getattr(obj, STATE_ATTR, None)
    return state if isinstance(state, DecodeLynxState) else None


def tracked_of(req: Any) -> tuple[DecodeLynxState, Tracked] | None:
    """The state tracking ``req`` and its record, or None when no scheduler tracks it."""
    state = state_of(req)
    if state is None:
        return None
    t = state.tracked.get(str(getattr(req, "rid", "")))
    return None if t is None or t.req is not req else (state, t)
