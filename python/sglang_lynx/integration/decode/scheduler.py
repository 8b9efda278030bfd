"""Progressive speculative decoding in SGLang's decode scheduler (mode ``lynx``): the hooks.

Admission on the anchor needs no hook: the Lynx receiver reports SGLang's KVPoll.Success once the
first token and the ANCHOR stream have landed and the anchor-only KV is in the pool, so
``DecodeTransferQueue.pop_transferred`` puts the request in ``waiting_queue``. From there, per request
(rid), on either decode loop (SGLang's default overlap loop or ``--disable-overlap-schedule``; see
*Batches in flight* below):

1. **track** (before every batch, AROUND ``get_next_disagg_decode_batch_to_run``): a new request whose
   bootstrap room has a Lynx progress gets a :class:`LynxRequestState` (DRAFTING, 1 verified token).
   If its residual already landed the KV is upgraded at once (0 drafts, NORMAL). Requests whose
   sampling cannot be verified exactly (penalties, logit bias, grammar, logprobs, ...:
   ``decode.sampling.speculation_blocker``) do not draft: they are parked until the residual lands
   and then decode normally (lossless, no speed-up; ``lynx_fallback`` says why). Sampling requests
   (temperature > 0) draft like greedy ones; the law each draft was sampled from is recorded
   (``decode.sampling``) for speculative sampling at verify.
2. **draft**: the request decodes in the running batch on the anchor-only KV. Its tokens beyond the
   verified count are withheld from the streamer (AROUND ``_GenerationStreamAccumulator.accept``);
   a non-abort finish (EOS, stop, max tokens) is undone while drafting (AROUND
   ``Req.update_finish_state``) and parks the request (nothing more is worth drafting).
3. **park** before the next batch when: the residual landed, ``max_draft_tokens`` drafts exist, a
   finish was undone, the residual failed or is late (``residual_timeout_s``): removed from the
   running batch with ``filter_batch``; kept in the server state's ``parked`` with its KV row.
4. **verify** (parked and residual landed): ``decode.commit.verify_parked_request`` (upgrade, one
   chain pass, greedy accept or speculative sampling, free rejected slots, replay finish); then the
   request goes back to ``waiting_queue`` and re-enters through SGLang's prebuilt path, which
   streams the verified tokens (or finishes and releases it). **fallback**: policy ``recompute``
   rebuilds the prompt KV on the decode server as a prefill computes it, then runs the same pass; policy ``fail``
   aborts the request with a clear error. Drafts are never released: a failing request's
   ``output_ids`` are cut to verified tokens.
5. **done**: when the request finishes (any reason) the Lynx progress is forgotten (or aborted) and
   the state dropped. Abort of a parked request (AROUND ``Scheduler.abort_request``) puts it back in
   ``waiting_queue`` first so SGLang's own abort path releases its KV. The scheduler does not sleep
   while requests are parked (AROUND ``Scheduler.maybe_sleep_on_idle``).

Batches in flight (the overlap loop, ``event_loop_overlap_disagg_decode``): the batch hook of step
i runs while batch i-1 has run but its result is not processed (it sits in ``scheduler.result_queue``
and is processed after batch i is launched). A request in that batch has one more token coming than
``output_ids`` shows and its KV row already holds the slot of that token's input. So: the draft count
and the max-tokens check count that pending token (:func:`_in_flight`), so a hold of k drafts or the
``max_draft_tokens`` cap park the request after exactly that many drafts and a max-tokens finish is
foreseen one step early; parking only removes the request from the running batch (the batch being
built now); every action on a parked request — verify, fallback, fail, internal failure, abort,
re-admission — waits until no batch in ``result_queue`` holds it, so its ``output_ids`` and KV
bookkeeping (allocated == committed == prompt + drafts) are final and no stale forward's token can
reach it after its KV was rewritten. A finish found by the processed result one step late (EOS or a
stop string on the pending token) leaves one more draft past it, which verify's finish replay drops.
With ``--disable-overlap-schedule`` ``result_queue`` is always empty and nothing waits.

Per-request ``meta_info`` fields (``lynx_*``) travel in ``req.customized_info`` (one value per output
token; a client reads the last): phase, anchor / residual landing times (seconds from the decode
side's metadata send, transport clock), drafts, accepted, verify seconds, fallback taken; when the
request finishes also ``lynx_pool_free_tokens`` (free KV slots after its release: leak checks) and
``lynx_server_counts`` (server totals: requests, drafts, accepted, verifies, fallbacks, failed).

Tensor parallelism: every decision above that depends on the transport (upgrade at admission, park,
verify, fallback, fail) reads the view all TP ranks agreed on for this pass
(``decode.rank_agreement``: one all-reduce over the TP CPU group per pass with tracked requests;
residual landed = on every rank, failed or late = on any), so the ranks park, verify and re-admit a
request in the same iteration and their forwards stay collective-aligned.

Per-request isolation: an exception in one request's Lynx handling (admission, upgrade, verify,
fallback, the stream hook) fails THAT request (``decode.actions.fail_internal``: FINISH_ABORT 500 with
the error, drafts cut, through the parked path so SGLang releases its KV); an exception outside any
one request is logged and the batch goes on. Neither stops the server.

State: every dict these hooks use belongs to the scheduler they run on
(``decode.state.DecodeLynxState``, created by the first batch hook on that scheduler and kept as
``scheduler._lynx``); nothing per request or per server is module-level. The per-request record and
the test-only residual holds live in ``decode.tracked``; the hooks that see only a request
(streaming, finish state) in ``decode.streaming``; what verify, fallback and fail do to a parked
request, in ``decode.actions``. This module owns the lifecycle.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import Action, LynxRequestState, Phase, next_action
from sglang_lynx.integration.decode import actions as decode_actions
from sglang_lynx.integration.decode import faults as decode_faults
from sglang_lynx.integration.decode import sampling as decode_sampling
from sglang_lynx.integration.decode.chain_attention import CHAIN_ATTENTION_HOOKS
from sglang_lynx.integration.decode.rank_agreement import agree_on_transport, agree_seeds
from sglang_lynx.integration.decode.row_gemm import ROW_GEMM_HOOKS
from sglang_lynx.integration.decode.state import DecodeLynxState, state_for, state_of, tracked_of
from sglang_lynx.integration.decode.streaming import STREAMING_HOOKS
from sglang_lynx.integration.decode.tracked import (
    HeldProgress,
    Tracked,
    generator_for,
    hold_from,
    ignores_residual,
    model_device,
    proposed_seed,
)
from sglang_lynx.integration.hook_targets import register
from sglang_lynx.transfer.trace import trace

logger = logging.getLogger("sglang_lynx.decode")


def _in_flight(scheduler: Any) -> set[int]:
    """``id`` of every unfinished request in a batch that ran but whose result SGLang has not processed
    (overlap loop: ``scheduler.result_queue`` holds ``(batch copy, result)``); empty in the normal loop."""
    queue = getattr(scheduler, "result_queue", None) or ()
    return {id(req) for batch, _ in queue for req in getattr(batch, "reqs", None) or () if not req.finished()}


# ----- 1. track newly admitted requests -----
def _track_new(s: DecodeLynxState) -> None:
    scheduler, side = s.scheduler, s.side
    held_back: list[Any] = []
    created: list[Tracked] = []
    for req in scheduler.waiting_queue:
        room = getattr(req, "bootstrap_room", None)
        if (room is None or req.rid in s.tracked or room not in side.inbound or len(req.output_ids) != 1
                or getattr(req, "to_finish", None) is not None):
            continue
        try:
            created.append(_track_one(s, req, room))
        except Exception as exc:  # this request fails, the others are tracked
            decode_actions.fail_untracked(s, req, room, decode_actions.internal_error(req.rid, "admission", exc))
    if not created:
        return
    # every TP rank decides each new request's start from the same view (decode.rank_agreement)
    agree_on_transport(s.scheduler, created, time.monotonic())
    sampling = [t for t in created if not t.greedy]
    if sampling:
        seeds = agree_seeds(s.scheduler, [proposed_seed(t.req) for t in sampling])
        for t, seed in zip(sampling, seeds, strict=True):
            t.generator = generator_for(t.req, seed, model_device(s.scheduler))
    for tracked in created:
        try:
            _start_one(s, tracked, held_back)
        except Exception as exc:  # this request fails, the others go on
            message = decode_actions.internal_error(tracked.req.rid, "admission", exc)
            s.parked.pop(tracked.req.rid, None)
            held_back = [r for r in held_back if r is not tracked.req]
            decode_actions.fail_internal(s, tracked, message)
    if held_back:
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r not in held_back]


def _track_one(s: DecodeLynxState, req: Any, room: int) -> Tracked:
    progress = s.side.inbound[room]
    state = LynxRequestState(rid=req.rid, config=s.config)
    # times from the transport: zero = the decode side's metadata send
    state.created_at = getattr(progress, "created", state.created_at)
    state.on_anchor_admitted(len(req.output_ids), decode_actions.landed_at(progress, "anchor"))
    trace().emit("admit", rid=str(room), req=str(req.rid))
    greedy = decode_sampling.is_greedy(req)
    tracked = Tracked(req, room, progress, state, greedy, decode_sampling.speculation_blocker(req),
                      None, hold_from(req), ignore_residual=ignores_residual(req))
    s.track(tracked)
    s.counts.count("requests", 1)
    decode_faults.on_admission(req, s.side)
    return tracked


def _start_one(s: DecodeLynxState, tracked: Tracked, held_back: list[Any]) -> None:
    req, state = tracked.req, tracked.state
    if tracked.residual_landed() and tracked.failure() is None:
        decode_actions.upgrade_without_drafts(s, tracked)
    elif tracked.blocker is not None or tracked.hold_drafts == 0:
        # no drafting (sampling that cannot be verified exactly, or the test hold "verify before
        # any draft"): wait out of the batch until the residual lands
        state.fallback = tracked.blocker
        tracked.hold_drafts = None
        held_back.append(req)
        s.parked[req.rid] = tracked
    elif not tracked.greedy:
        s.laws.watch(req.rid, s.config.max_draft_tokens)


# ----- 3. park -----
def _needs_parking(s: DecodeLynxState, t: Tracked, now: float, pending: int = 0) -> bool:
    if t.internal_error is not None:
        return True  # failed at the next service of the parked requests
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return False
    if t.blocker is not None or t.finish_undone:
        return True
    max_new = getattr(t.req.sampling_params, "max_new_tokens", None)
    if pending and max_new is not None and len(t.req.output_ids) + pending >= int(max_new):
        return True  # the pending token reaches max tokens: its finish is undone, nothing more to draft
    return _agreed_action(s, t, now) is not Action.DRAFT


def _agreed_action(s: DecodeLynxState, t: Tracked, now: float) -> Action:
    """The next action from the view every TP rank shares (``t.agreed_*``): a residual deadline is
    passed when it passed on any rank."""
    return next_action(t.state.phase, HeldProgress(t), t.state.num_drafts, now if t.agreed_late else None,
                       now, s.config)


def _sync_drafts(s: DecodeLynxState, t: Tracked, pending: int = 0) -> None:
    """Draft count from ``output_ids`` plus the ``pending`` token of a batch in flight (overlap loop)."""
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return
    t.state.num_drafts = len(t.req.output_ids) + pending - t.state.verified_output_len
    if t.state.phase is Phase.DRAFTING and t.state.num_drafts >= s.config.max_draft_tokens:
        t.state.advance(Phase.WAITING_RESIDUAL)


def _park_running(s: DecodeLynxState, running_batch: Any, now: float, in_flight: set[int]) -> None:
    to_park = []
    for req in list(running_batch.reqs):
        t = s.tracked.get(req.rid)
        if t is None or req.finished():
            continue
        pending = 1 if id(req) in in_flight else 0
        try:
            _sync_drafts(s, t, pending)
            park = _needs_parking(s, t, now, pending)
        except Exception as exc:  # parked and failed: out of the batch before its drafts go further
            t.internal_error, park = decode_actions.internal_error(req.rid, "parking", exc), True
        if park:
            to_park.append(req)
            s.parked[req.rid] = t
    if to_park:
        running_batch.filter_batch(reqs_to_exclude=to_park)


# ----- 4. verify / fallback / fail -----
_STAGES = {Action.VERIFY: "verify", Action.FALLBACK_RECOMPUTE: "the recompute fallback",
           Action.FAIL: "the fail policy"}


def _service_parked(s: DecodeLynxState, now: float, in_flight: set[int]) -> None:
    for rid, t in list(s.parked.items()):
        if id(t.req) in in_flight:
            continue  # its last batch's result is not processed yet: output_ids and KV not final
        if t.abort_requested:
            _abort_parked(s, t)
            continue
        stage = "the residual check"
        try:
            if t.internal_error is None:
                _sync_drafts(s, t)
                action = _agreed_action(s, t, now)
                if action not in _STAGES:
                    continue
                stage = _STAGES[action]
                if action is Action.FAIL:
                    decode_actions.fail(s, t)
                else:
                    decode_actions.verify(s, t, "verify" if action is Action.VERIFY else "recompute")
        except Exception as exc:  # this request fails (500, drafts cut); the others go on
            t.internal_error = decode_actions.internal_error(rid, stage, exc)
        if t.internal_error is not None:
            decode_actions.fail_internal(s, t, t.internal_error)
        s.parked.pop(rid, None)
        _readmit(s, t.req)


def _readmit(s: DecodeLynxState, req: Any) -> None:
    """Back through SGLang's prebuilt path. Its ``init_next_round_input`` re-matches the request
    against the tree cache, which on a re-admission finds the request's own checkpointed KV and
    marks it protected, so the release at finish would free nothing (measured: the whole row
    leaked). The KV row is unchanged by parking, so the prefix bookkeeping of the first admission
    is restored after that call (see :func:`_around_init_next_round_input`)."""
    s.readmitted[req.rid] = (getattr(req, "prefix_len", 0), getattr(req.kv, "cache_protected_len", 0))
    s.scheduler.waiting_queue.append(req)


def _around_init_next_round_input(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    found = tracked_of(req)
    saved = found[0].readmitted.pop(req.rid, None) if found is not None else None
    result = original(req, *args, **kwargs)
    if saved is not None:
        req.prefix_len, req.kv.cache_protected_len = saved
    return result


# ----- the hooks -----
def _around_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    try:
        _lynx_pass(state_for(scheduler), running_batch)
    except Exception:  # outside any one request (those are failed where they raise): the batch goes on
        logger.exception("lynx: the decode hooks raised outside a request; this batch runs without them")
    return original(scheduler, running_batch)


def _lynx_pass(s: DecodeLynxState, running_batch: Any) -> None:
    s.laws.retain(s.tracked)
    if s.tracked or s.scheduler.waiting_queue:
        _track_new(s)
    if s.tracked:
        s.side.tracker.expire()
        now = time.monotonic()
        agree_on_transport(s.scheduler, list(s.tracked.values()), now)
        _upgrade_drafting_to_residual(s)
        in_flight = _in_flight(s.scheduler)
        if running_batch is not None and not running_batch.is_empty():
            _park_running(s, running_batch, now, in_flight)
        if s.parked:
            _service_parked(s, now, in_flight)


def _upgrade_drafting_to_residual(s: DecodeLynxState) -> None:
    """``lynx-exact``: a drafting request whose residual landed before its exact stream drafts on from
    the 8-bit KV (``InboundProgress.upgrade_to_residual``; a pool write between batches, as the verify's
    upgrade). Ranks need not agree on it: it changes drafts only, and every rank sees the same
    all-reduced logits whichever stage its own heads are at."""
    for t in list(s.tracked.values()):
        if t.state.phase is not Phase.DRAFTING or t.agreed_landed or t.agreed_failed:
            continue
        try:
            if t.progress.upgrade_to_residual():
                s.counts.count("residual_upgrades", 1)
        except Exception as exc:  # the drafts go on from the anchor; the verify restores the exact KV
            logger.warning("lynx: request %s: the 8-bit upgrade while drafting failed: %s", t.req.rid, exc)


def _abort_parked(s: DecodeLynxState, t: Tracked) -> None:
    """End a parked request whose abort came while a batch of it was in flight: drafts cut, then
    SGLang's prebuilt path finishes it as ``to_finish`` (its KV row released, the abort streamed;
    the streaming hook then drops its state and aborts its Lynx transfer)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    s.parked.pop(t.req.rid, None)
    decode_actions.truncate_to_verified(t)
    s.laws.forget(t.req.rid)
    if t.state.phase not in (Phase.FAILED, Phase.ABORTED, Phase.NORMAL):
        t.state.advance(Phase.ABORTED)
    t.req.finished_reason, t.req.finished_len = None, None
    t.req.to_finish = FINISH_ABORT()
    _readmit(s, t.req)


def _around_abort_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    s = state_of(scheduler)
    if s is not None:
        in_flight = _in_flight(scheduler)
        for rid, t in list(s.parked.items()):
            if recv_req.abort_all or rid.startswith(recv_req.rid):
                if id(t.req) in in_flight:
                    # its last batch's result is still to be processed (overlap loop): aborted at the
                    # next batch hook, once output_ids and the KV row are final (``_abort_parked``)
                    t.abort_requested = True
                    continue
                s.parked.pop(rid, None)
                decode_actions.truncate_to_verified(t)
                if t.state.phase not in (Phase.FAILED, Phase.ABORTED, Phase.NORMAL):
                    t.state.advance(Phase.ABORTED)
                s.done(t)
                scheduler.waiting_queue.append(t.req)  # SGLang's waiting-queue abort releases the KV row
    return original(scheduler, recv_req)


def _has_parked(scheduler: Any) -> bool:
    s = state_of(scheduler)
    return s is not None and bool(s.parked)


def _around_sleep(original: Any, scheduler: Any) -> Any:
    if _has_parked(scheduler):
        return None  # parked requests wait on their residual: keep polling
    return original(scheduler)


def _around_is_fully_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    if _has_parked(scheduler):
        return False  # parked requests own KV rows: not idle (and SGLang's idle leak check must not run)
    return original(scheduler, *args, **kwargs)


SCHEDULER_HOOKS = (
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
     _around_next_batch, "around"),
    *STREAMING_HOOKS,
    ("sglang.srt.managers.schedule_batch.Req.init_next_round_input", _around_init_next_round_input, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.abort_request", _around_abort_request, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", _around_sleep, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.is_fully_idle", _around_is_fully_idle, "around"),
)


def install_scheduler_hooks(config: LynxConfig) -> None:
    """Register the hooks (``config`` is the process's; each scheduler's state reads its own Lynx side's)."""
    for path, hook, kind in (*SCHEDULER_HOOKS, *decode_sampling.SAMPLING_HOOKS, *ROW_GEMM_HOOKS,
                             *CHAIN_ATTENTION_HOOKS):
        register(path, hook, kind)
