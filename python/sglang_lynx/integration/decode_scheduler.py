"""Progressive speculative decoding in SGLang's decode scheduler (mode ``lynx``): the hooks.

Admission on the anchor needs no hook: the Lynx receiver reports SGLang's KVPoll.Success once the
first token and the ANCHOR stream have landed and the anchor-only KV is in the pool, so
``DecodeTransferQueue.pop_transferred`` puts the request in ``waiting_queue``. From there, per request
(rid), with the scheduler loop run WITHOUT the overlap scheduler (``--disable-overlap-schedule`` is
required and checked at start-up):

1. **track** (before every batch, AROUND ``get_next_disagg_decode_batch_to_run``): a new request whose
   bootstrap room has a Lynx progress gets a :class:`LynxRequestState` (DRAFTING, 1 verified token).
   If its residual already landed the KV is upgraded at once (0 drafts, NORMAL). Requests whose
   sampling cannot be verified exactly (penalties, logit bias, grammar, logprobs, ...:
   ``decode_sampling.speculation_blocker``) do not draft: they are parked until the residual lands
   and then decode normally (lossless, no speed-up; ``lynx_fallback`` says why). Sampling requests
   (temperature > 0) draft like greedy ones; the law each draft was sampled from is recorded
   (``decode_sampling``) for speculative sampling at verify.
2. **draft**: the request decodes in the running batch on the anchor-only KV. Its tokens beyond the
   verified count are withheld from the streamer (AROUND ``_GenerationStreamAccumulator.accept``);
   a non-abort finish (EOS, stop, max tokens) is undone while drafting (AROUND
   ``Req.update_finish_state``) and parks the request (nothing more is worth drafting).
3. **park** before the next batch when: the residual landed, ``max_draft_tokens`` drafts exist, a
   finish was undone, the residual failed or is late (``residual_timeout_s``): removed from the
   running batch with ``filter_batch``; kept in :data:`_PARKED` with its KV row.
4. **verify** (parked and residual landed): ``decode_commit.verify_parked_request`` (upgrade, one
   chain pass, greedy accept or speculative sampling, free rejected slots, replay finish); then the
   request goes back to ``waiting_queue`` and re-enters through SGLang's prebuilt path, which
   streams the verified tokens (or finishes and releases it). **fallback**: policy ``recompute``
   runs the same pass from position 0 (prompt KV recomputed on the decode server); policy ``fail``
   aborts the request with a clear error. Drafts are never released: a failing request's
   ``output_ids`` are cut to verified tokens.
5. **done**: when the request finishes (any reason) the Lynx progress is forgotten (or aborted) and
   the state dropped. Abort of a parked request (AROUND ``Scheduler.abort_request``) puts it back in
   ``waiting_queue`` first so SGLang's own abort path releases its KV. The scheduler does not sleep
   while requests are parked (AROUND ``Scheduler.maybe_sleep_on_idle``).

Per-request ``meta_info`` fields (``lynx_*``) travel in ``req.customized_info`` (one value per output
token; a client reads the last): phase, anchor / residual landing times (seconds from the decode
side's metadata send, transport clock), drafts, accepted, verify seconds, fallback taken; when the
request finishes also ``lynx_pool_free_tokens`` (free KV slots after its release: leak checks) and
``lynx_server_counts`` (server totals: requests, drafts, accepted, verifies, fallbacks, failed).

Per-request isolation: an exception in one request's Lynx handling (admission, upgrade, verify,
fallback, the stream hook) fails THAT request (``decode_actions.fail_internal``: FINISH_ABORT 500 with
the error, drafts cut, through the parked path so SGLang releases its KV); an exception outside any
one request is logged and the batch goes on. Neither stops the server.

The per-request record and the test-only residual holds live in ``decode_tracked``; what verify,
fallback and fail do to a parked request, in ``decode_actions``. This module owns the lifecycle.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import Action, LynxRequestState, Phase, next_action
from sglang_lynx.integration import decode_actions, decode_sampling
from sglang_lynx.integration.decode_metrics import COUNTS, count
from sglang_lynx.integration.decode_row_gemm import ROW_GEMM_HOOKS
from sglang_lynx.integration.decode_tracked import (
    HeldProgress,
    Tracked,
    generator_for,
    hold_from,
    ignores_residual,
)
from sglang_lynx.integration.hook_targets import register

logger = logging.getLogger("sglang_lynx.decode")

OVERLAP_MESSAGE = ("sglang-lynx: mode 'lynx' (progressive speculative decoding) needs "
                   "--disable-overlap-schedule on the decode server (the overlap scheduler is not supported yet)")

_CONFIG: LynxConfig | None = None
_TRACKED: dict[str, Tracked] = {}
_PARKED: dict[str, Tracked] = {}
_SIDE: dict[str, Any] = {}
_READMITTED: dict[str, tuple[int, int]] = {}  # rid -> (prefix_len, cache_protected_len) at parking


def _lynx_side(scheduler: Any) -> Any:
    return scheduler.disagg_decode_prealloc_queue.kv_manager.lynx


# ----- 1. track newly admitted requests -----
def _track_new(scheduler: Any) -> None:
    side = _lynx_side(scheduler)
    _SIDE["side"] = side
    held_back: list[Any] = []
    for req in scheduler.waiting_queue:
        room = getattr(req, "bootstrap_room", None)
        if (room is None or req.rid in _TRACKED or room not in side.inbound or len(req.output_ids) != 1
                or getattr(req, "to_finish", None) is not None):
            continue
        try:
            _track_one(side, req, room, held_back)
        except Exception as exc:  # this request fails, the others are tracked
            message = decode_actions.internal_error(req.rid, "admission", exc)
            t = _TRACKED.get(req.rid)
            if t is not None:
                _PARKED.pop(req.rid, None)
                held_back = [r for r in held_back if r is not req]
                decode_actions.fail_internal(side, t, message)
            else:
                decode_actions.fail_untracked(side, req, room, message)
    if held_back:
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r not in held_back]


def _track_one(side: Any, req: Any, room: int, held_back: list[Any]) -> None:
    progress = side.inbound[room]
    state = LynxRequestState(rid=req.rid, config=_config())
    # times from the transport: zero = the decode side's metadata send
    state.created_at = getattr(progress, "created", state.created_at)
    state.on_anchor_admitted(len(req.output_ids), decode_actions.landed_at(progress, "anchor"))
    greedy = decode_sampling.is_greedy(req)
    tracked = Tracked(req, room, progress, state, greedy, decode_sampling.speculation_blocker(req),
                      None if greedy else generator_for(req), hold_from(req),
                      ignore_residual=ignores_residual(req))
    _TRACKED[req.rid] = tracked
    count("requests", 1)
    if tracked.residual_landed() and tracked.progress.failure() is None:
        decode_actions.upgrade_without_drafts(side, tracked)
    elif tracked.blocker is not None or tracked.hold_drafts == 0:
        # no drafting (sampling that cannot be verified exactly, or the test hold "verify before
        # any draft"): wait out of the batch until the residual lands
        state.fallback = tracked.blocker
        tracked.hold_drafts = None
        held_back.append(req)
        _PARKED[req.rid] = tracked
    elif not greedy:
        decode_sampling.watch(req.rid, _config().max_draft_tokens)


# ----- 3. park -----
def _needs_parking(t: Tracked, now: float) -> bool:
    if t.internal_error is not None:
        return True  # failed at the next service of the parked requests
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return False
    if t.blocker is not None or t.finish_undone:
        return True
    action = next_action(t.state.phase, HeldProgress(t), t.state.num_drafts, t.state.residual_deadline(),
                         now, _config())
    return action is not Action.DRAFT


def _sync_drafts(t: Tracked) -> None:
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return
    t.state.num_drafts = len(t.req.output_ids) - t.state.verified_output_len
    if t.state.phase is Phase.DRAFTING and t.state.num_drafts >= _config().max_draft_tokens:
        t.state.advance(Phase.WAITING_RESIDUAL)


def _park_running(scheduler: Any, running_batch: Any, now: float) -> None:
    to_park = []
    for req in list(running_batch.reqs):
        t = _TRACKED.get(req.rid)
        if t is None or req.finished():
            continue
        try:
            _sync_drafts(t)
            park = _needs_parking(t, now)
        except Exception as exc:  # parked and failed: out of the batch before its drafts go further
            t.internal_error, park = decode_actions.internal_error(req.rid, "parking", exc), True
        if park:
            to_park.append(req)
            _PARKED[req.rid] = t
    if to_park:
        running_batch.filter_batch(reqs_to_exclude=to_park)


# ----- 4. verify / fallback / fail -----
_STAGES = {Action.VERIFY: "verify", Action.FALLBACK_RECOMPUTE: "the recompute fallback",
           Action.FAIL: "the fail policy"}


def _service_parked(scheduler: Any, now: float) -> None:
    side = _lynx_side(scheduler)
    for rid, t in list(_PARKED.items()):
        stage = "the residual check"
        try:
            if t.internal_error is None:
                _sync_drafts(t)
                action = next_action(t.state.phase, HeldProgress(t), t.state.num_drafts,
                                     t.state.residual_deadline(), now, _config())
                if action not in _STAGES:
                    continue
                stage = _STAGES[action]
                if action is Action.FAIL:
                    decode_actions.fail(side, t, _config())
                else:
                    decode_actions.verify(scheduler, side, t, "verify" if action is Action.VERIFY else "recompute",
                                          _config())
        except Exception as exc:  # this request fails (500, drafts cut); the others go on
            t.internal_error = decode_actions.internal_error(rid, stage, exc)
        if t.internal_error is not None:
            decode_actions.fail_internal(side, t, t.internal_error)
        _PARKED.pop(rid, None)
        _readmit(scheduler, t.req)


def _readmit(scheduler: Any, req: Any) -> None:
    """Back through SGLang's prebuilt path. Its ``init_next_round_input`` re-matches the request
    against the tree cache, which on a re-admission finds the request's own checkpointed KV and
    marks it protected, so the release at finish would free nothing (measured: the whole row
    leaked). The KV row is unchanged by parking, so the prefix bookkeeping of the first admission
    is restored after that call (see :func:`_around_init_next_round_input`)."""
    _READMITTED[req.rid] = (getattr(req, "prefix_len", 0), getattr(req.kv, "cache_protected_len", 0))
    scheduler.waiting_queue.append(req)


def _around_init_next_round_input(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    saved = _READMITTED.pop(str(getattr(req, "rid", "")), None) if _READMITTED else None
    result = original(req, *args, **kwargs)
    if saved is not None:
        req.prefix_len, req.kv.cache_protected_len = saved
    return result


def _config() -> LynxConfig:
    assert _CONFIG is not None, "install_scheduler_hooks was not called"
    return _CONFIG


# ----- the hooks -----
def _around_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    try:
        _lynx_pass(scheduler, running_batch)
    except Exception:  # outside any one request (those are failed where they raise): the batch goes on
        logger.exception("lynx: the decode hooks raised outside a request; this batch runs without them")
    return original(scheduler, running_batch)


def _lynx_pass(scheduler: Any, running_batch: Any) -> None:
    _SIDE["scheduler"] = scheduler
    decode_sampling.retain(_TRACKED)
    if _TRACKED or scheduler.waiting_queue:
        _track_new(scheduler)
    if _TRACKED:
        _lynx_side(scheduler).tracker.expire()
        now = time.monotonic()
        if running_batch is not None and not running_batch.is_empty():
            _park_running(scheduler, running_batch, now)
        if _PARKED:
            _service_parked(scheduler, now)


def _around_accept(original: Any, accumulator: Any, *, req: Any) -> Any:
    t = _TRACKED.get(req.rid)
    if t is None:
        return original(accumulator, req=req)
    try:
        release = _before_accept(t, req)
    except Exception as exc:  # this request only: never stream what may be a draft
        message = decode_actions.internal_error(req.rid, "streaming", exc)
        release = req.finished()
        if release:  # finishing anyway: cut to verified tokens and let SGLang stream the end
            decode_actions.truncate_to_verified(t)
            _done(t)
        else:
            t.internal_error = message  # parked and failed before the next batch
    return original(accumulator, req=req) if release else None


def _before_accept(t: Tracked, req: Any) -> bool:
    """Lynx's part of streaming ``req``: False to withhold (drafts), True to let SGLang stream it."""
    if req.finished():
        in_flight = t.state.phase in (Phase.DRAFTING, Phase.WAITING_RESIDUAL)
        if in_flight and _finished_on_verified(t):
            # e.g. the exact first token from the prefill is EOS: a normal finish, nothing drafted
            t.state.advance(Phase.VERIFYING)
            t.state.on_verified(0, len(req.output_ids), 0.0)
        elif in_flight:  # aborted while drafting
            decode_actions.truncate_to_verified(t)
            t.state.advance(Phase.ABORTED)
        _done(t, residual_may_land=in_flight)
    elif len(req.output_ids) > t.state.releasable_output_len(len(req.output_ids)):
        return False  # drafts: never streamed
    info: dict[str, Any] = dict(t.state.meta_info())
    scheduler = _SIDE.get("scheduler")
    if req.finished() and scheduler is not None:  # leak checks: free pool tokens when this one is done
        info["lynx_pool_free_tokens"] = int(scheduler.token_to_kv_pool_allocator.available_size())
        info["lynx_server_counts"] = dict(COUNTS)
    req.customized_info = {k: [v] * len(req.output_ids) for k, v in info.items()}
    return True


def _finished_on_verified(t: Tracked) -> bool:
    """The request finished (not by abort) with no draft in ``output_ids``: a verified token ended it."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return (len(t.req.output_ids) <= t.state.verified_output_len
            and not isinstance(t.req.finished_reason, FINISH_ABORT))


def _done(t: Tracked, residual_may_land: bool = False) -> None:
    _TRACKED.pop(t.req.rid, None)
    _PARKED.pop(t.req.rid, None)
    decode_sampling.forget(t.req.rid)
    side = _SIDE.get("side")
    if side is None:
        return
    try:
        if t.state.phase is Phase.NORMAL and not residual_may_land:
            side.forget(t.room)
        else:
            side.abort(t.room, f"request finished in phase {t.state.phase.name}")
    except Exception:  # the request is done either way; the transport's own sweep reclaims it
        logger.exception("lynx: %s: releasing the Lynx transfer at the finish raised", t.req.rid)


def _around_update_finish_state(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(req, *args, **kwargs)
    t = _TRACKED.get(str(getattr(req, "rid", ""))) if _TRACKED else None
    if t is None or t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return result
    if len(req.output_ids) <= t.state.verified_output_len:
        return result  # the finish is on a verified token (the first one, from the prefill): it stands
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN

    if isinstance(req.finished_reason, (FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN)):
        req.finished_reason = None  # decided after verification (replayed token by token)
        req.finished_len = None
        t.finish_undone = True
    return result


def _around_abort_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    for rid, t in list(_PARKED.items()):
        if recv_req.abort_all or rid.startswith(recv_req.rid):
            _PARKED.pop(rid, None)
            decode_actions.truncate_to_verified(t)
            if t.state.phase not in (Phase.FAILED, Phase.ABORTED, Phase.NORMAL):
                t.state.advance(Phase.ABORTED)
            _done(t)
            scheduler.waiting_queue.append(t.req)  # SGLang's waiting-queue abort releases the KV row
    return original(scheduler, recv_req)


def _around_sleep(original: Any, scheduler: Any) -> Any:
    if _PARKED:
        return None  # parked requests wait on their residual: keep polling
    return original(scheduler)


def _around_is_fully_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    if _PARKED:
        return False  # parked requests own KV rows: not idle (and SGLang's idle leak check must not run)
    return original(scheduler, *args, **kwargs)


def _refuse_overlap(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(OVERLAP_MESSAGE)


SCHEDULER_HOOKS = (
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
     _around_next_batch, "around"),
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.event_loop_overlap_disagg_decode",
     _refuse_overlap, "around"),
    ("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
     _around_accept, "around"),
    ("sglang.srt.managers.schedule_batch.Req.update_finish_state", _around_update_finish_state, "around"),
    ("sglang.srt.managers.schedule_batch.Req.init_next_round_input", _around_init_next_round_input, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.abort_request", _around_abort_request, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", _around_sleep, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.is_fully_idle", _around_is_fully_idle, "around"),
)


def install_scheduler_hooks(config: LynxConfig) -> None:
    global _CONFIG
    _CONFIG = config
    for path, hook, kind in (*SCHEDULER_HOOKS, *decode_sampling.SAMPLING_HOOKS, *ROW_GEMM_HOOKS):
        register(path, hook, kind)
