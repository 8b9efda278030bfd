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

Test-only (``SGLANG_LYNX_TEST_HOOKS=1`` on the decode server, read per request from
``sampling_params.custom_params``): ``lynx_test_hold_residual_drafts = k`` — the residual counts as
landed only once k drafts exist or the draft window closed (k = 0: verify before any draft);
``lynx_test_ignore_residual = true`` — the residual never counts (the late-residual policy runs).
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.speculative import auto_tie_margin
from sglang_lynx.decode.state import Action, LynxRequestState, Phase, next_action
from sglang_lynx.integration import decode_sampling
from sglang_lynx.integration.decode_commit import SamplingVerify, verify_parked_request
from sglang_lynx.integration.decode_metrics import COUNTS, count
from sglang_lynx.integration.hook_targets import register

logger = logging.getLogger("sglang_lynx.decode")

TEST_HOOKS_ENV = "SGLANG_LYNX_TEST_HOOKS"
HOLD_RESIDUAL_KEY = "lynx_test_hold_residual_drafts"
IGNORE_RESIDUAL_KEY = "lynx_test_ignore_residual"
OVERLAP_MESSAGE = ("sglang-lynx: mode 'lynx' (progressive speculative decoding) needs "
                   "--disable-overlap-schedule on the decode server (the overlap scheduler is not supported yet)")

_CONFIG: LynxConfig | None = None
_TRACKED: dict[str, Tracked] = {}
_PARKED: dict[str, Tracked] = {}
_SIDE: dict[str, Any] = {}
_READMITTED: dict[str, tuple[int, int]] = {}  # rid -> (prefix_len, cache_protected_len) at parking


@dataclass
class Tracked:
    req: Any
    room: int
    progress: Any  # InboundProgress of the transport (LandingProgress)
    state: LynxRequestState
    greedy: bool
    blocker: str | None = None  # why this request may not draft (decode_sampling.speculation_blocker)
    generator: torch.Generator | None = None  # sampling requests: uniforms for speculative sampling
    hold_drafts: int | None = None
    finish_undone: bool = False
    ignore_residual: bool = False  # test only: the residual never counts (forces the late-residual policy)

    def residual_landed(self) -> bool:
        if self.ignore_residual:
            return False
        if self.hold_drafts is not None and self.state.num_drafts < self.hold_drafts and not self.finish_undone \
                and self.state.phase is Phase.DRAFTING:
            return False  # test hold: not before k drafts, unless the draft window already closed
        return bool(self.progress.residual_landed())


class _HeldProgress:
    """The transport's progress as the decision function sees it (test hold applied)."""

    def __init__(self, tracked: Tracked) -> None:
        self.t = tracked

    def anchor_landed(self) -> bool:
        return bool(self.t.progress.anchor_landed())

    def residual_landed(self) -> bool:
        return self.t.residual_landed()

    def failure(self) -> str | None:
        return self.t.progress.failure()  # type: ignore[no-any-return]

    def upgrade_kv(self) -> None:
        self.t.progress.upgrade_kv()


def _lynx_side(scheduler: Any) -> Any:
    return scheduler.disagg_decode_prealloc_queue.kv_manager.lynx


def _generator_for(req: Any) -> torch.Generator:
    """A request's own uniforms: reproducible from ``sampling_seed`` when the client gives one."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    return torch.Generator().manual_seed(int(seed) if seed is not None else random.getrandbits(63))


def _test_params(req: Any) -> dict[str, Any]:
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        return {}
    return dict(getattr(req.sampling_params, "custom_params", None) or {})


def _hold_from(req: Any) -> int | None:
    value = _test_params(req).get(HOLD_RESIDUAL_KEY)
    return None if value is None else int(value)


# ----- 1. track newly admitted requests -----
def _track_new(scheduler: Any) -> None:
    side = _lynx_side(scheduler)
    _SIDE["side"] = side
    held_back = []
    for req in scheduler.waiting_queue:
        room = getattr(req, "bootstrap_room", None)
        if room is None or req.rid in _TRACKED or room not in side.inbound or len(req.output_ids) != 1:
            continue
        progress = side.inbound[room]
        state = LynxRequestState(rid=req.rid, config=_config())
        # times from the transport: zero = the decode side's metadata send
        state.created_at = getattr(progress, "created", state.created_at)
        state.on_anchor_admitted(len(req.output_ids), _landed_at(progress, "anchor"))
        greedy = decode_sampling.is_greedy(req)
        tracked = Tracked(req, room, progress, state, greedy, decode_sampling.speculation_blocker(req),
                          None if greedy else _generator_for(req), _hold_from(req),
                          ignore_residual=bool(_test_params(req).get(IGNORE_RESIDUAL_KEY)))
        _TRACKED[req.rid] = tracked
        count("requests", 1)
        if tracked.residual_landed() and tracked.progress.failure() is None:
            _upgrade_without_drafts(scheduler, tracked)
        elif tracked.blocker is not None or tracked.hold_drafts == 0:
            # no drafting (sampling that cannot be verified exactly, or the test hold "verify before
            # any draft"): wait out of the batch until the residual lands
            state.fallback = tracked.blocker
            tracked.hold_drafts = None
            held_back.append(req)
            _PARKED[req.rid] = tracked
        elif not greedy:
            decode_sampling.watch(req.rid)
    if held_back:
        scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r not in held_back]


def _landed_at(progress: Any, stream: str) -> float | None:
    """When the transport saw ``stream`` land (monotonic clock), None if unknown."""
    from sglang_lynx.transfer.streams import StreamKind

    inbound = progress.request
    if inbound is None:
        return None
    return inbound.landed_at.get(StreamKind(stream))  # type: ignore[no-any-return]


def _upgrade_without_drafts(scheduler: Any, t: Tracked) -> None:
    """Residual landed before any draft: upgrade the prompt KV in place, decode normally from here."""
    started = time.monotonic()
    t.state.residual_landed_at = _landed_at(t.progress, "residual") or started
    t.state.advance(Phase.VERIFYING)
    t.progress.upgrade_kv()
    t.state.on_verified(0, len(t.req.output_ids), time.monotonic() - started)
    decode_sampling.forget(t.req.rid)
    _lynx_side(scheduler).forget(t.room)


# ----- 3. park -----
def _needs_parking(t: Tracked, now: float) -> bool:
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return False
    if t.blocker is not None or t.finish_undone:
        return True
    action = next_action(t.state.phase, _HeldProgress(t), t.state.num_drafts, t.state.residual_deadline(),
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
        _sync_drafts(t)
        if _needs_parking(t, now):
            to_park.append(req)
            _PARKED[req.rid] = t
    if to_park:
        running_batch.filter_batch(reqs_to_exclude=to_park)


# ----- 4. verify / fallback / fail -----
def _service_parked(scheduler: Any, now: float) -> None:
    for rid, t in list(_PARKED.items()):
        _sync_drafts(t)
        action = next_action(t.state.phase, _HeldProgress(t), t.state.num_drafts, t.state.residual_deadline(),
                             now, _config())
        if action is Action.VERIFY:
            _verify(scheduler, t, "verify")
        elif action is Action.FALLBACK_RECOMPUTE:
            _verify(scheduler, t, "recompute")
        elif action is Action.FAIL:
            _fail(scheduler, t)
        else:
            continue
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


def _verify(scheduler: Any, t: Tracked, mode: str) -> None:
    started = time.monotonic()
    side = _lynx_side(scheduler)
    if mode == "verify" and t.state.num_drafts == 0:
        _upgrade_without_drafts(scheduler, t)
        return
    if mode == "verify":
        t.state.residual_landed_at = _landed_at(t.progress, "residual") or started
        t.state.advance(Phase.VERIFYING)
    else:
        reason = t.progress.failure() or f"residual not landed {_config().residual_timeout_s} s after the anchor"
        t.state.fallback = f"recompute ({reason})"
        t.state.advance(Phase.FALLBACK)
        side.abort(t.room, f"fallback to recompute: {reason}")
        count("fallbacks", 1)
    sampling = None
    if not t.greedy:
        assert t.generator is not None
        drafts = list(t.req.output_ids[1:])
        sampling = SamplingVerify(t.req.sampling_params, decode_sampling.draft_probs_for(t.req.rid, drafts),
                                  t.generator)
        if drafts and sampling.draft_probs is None:
            logger.warning("lynx: %s: no exact record of the draft distributions; all %d drafts rejected",
                           t.req.rid, len(drafts))
    runner = scheduler.tp_worker.model_runner
    margin = auto_tie_margin(_config().verify_tie_margin, getattr(runner, "dtype", torch.float32))
    outcome = verify_parked_request(t.req, runner, scheduler.tree_cache, t.progress, mode, sampling, margin)
    decode_sampling.forget(t.req.rid)
    seconds = time.monotonic() - started
    if outcome.finished:
        # SGLang's prebuilt path must not see a finished request (it checkpoints its KV first): hand
        # the finish over as ``to_finish``, which the prebuilt result processing turns into the finish
        # (release + stream) exactly as for its own grammar aborts; finished_len stays as replayed
        t.req.to_finish, t.req.finished_reason = t.req.finished_reason, None
    if mode == "verify":
        t.state.on_verified(outcome.num_accepted, outcome.new_output_len, seconds)
        side.forget(t.room)
    else:
        t.state.num_accepted += outcome.num_accepted
        t.state.num_verifies += 1
        t.state.verify_time_s += seconds
        t.state.verified_output_len = outcome.new_output_len
        t.state.advance(Phase.NORMAL)
    count("drafts", outcome.num_drafts)
    count("accepted", outcome.num_accepted)
    count("verifies", 1)
    logger.info("lynx: %s %s: %d drafts, %d accepted, %.3f s%s", mode, t.req.rid, outcome.num_drafts,
                outcome.num_accepted, seconds, " (finished)" if outcome.finished else "")


def _fail(scheduler: Any, t: Tracked) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reason = t.progress.failure() or f"residual not landed {_config().residual_timeout_s} s after the anchor"
    message = f"sglang-lynx: the KV residual of this request did not arrive ({reason}); fallback policy 'fail'"
    t.state.failure = message
    t.state.advance(Phase.FAILED)
    _truncate_to_verified(t)
    decode_sampling.forget(t.req.rid)
    t.req.to_finish = FINISH_ABORT(message, 500)
    _lynx_side(scheduler).abort(t.room, reason)
    count("failed", 1)


def _truncate_to_verified(t: Tracked) -> None:
    """Drop drafts from output_ids (their KV stays allocated and is released with the row)."""
    keep = t.state.verified_output_len
    if len(t.req.output_ids) > keep:
        del t.req.output_ids[keep:]


def _config() -> LynxConfig:
    assert _CONFIG is not None, "install_scheduler_hooks was not called"
    return _CONFIG


# ----- the hooks -----
def _around_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    _SIDE["scheduler"] = scheduler
    if _TRACKED or scheduler.waiting_queue:
        _track_new(scheduler)
    if _TRACKED:
        _lynx_side(scheduler).tracker.expire()
        now = time.monotonic()
        if running_batch is not None and not running_batch.is_empty():
            _park_running(scheduler, running_batch, now)
        if _PARKED:
            _service_parked(scheduler, now)
    return original(scheduler, running_batch)


def _around_accept(original: Any, accumulator: Any, *, req: Any) -> Any:
    t = _TRACKED.get(req.rid)
    if t is None:
        return original(accumulator, req=req)
    if req.finished():
        if t.state.phase in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):  # aborted while drafting
            _truncate_to_verified(t)
            t.state.advance(Phase.ABORTED)
        _done(t)
    elif len(req.output_ids) > t.state.releasable_output_len(len(req.output_ids)):
        return None  # drafts: never streamed
    info: dict[str, Any] = dict(t.state.meta_info())
    scheduler = _SIDE.get("scheduler")
    if req.finished() and scheduler is not None:  # leak checks: free pool tokens when this one is done
        info["lynx_pool_free_tokens"] = int(scheduler.token_to_kv_pool_allocator.available_size())
        info["lynx_server_counts"] = dict(COUNTS)
    req.customized_info = {k: [v] * len(req.output_ids) for k, v in info.items()}
    return original(accumulator, req=req)


def _done(t: Tracked) -> None:
    _TRACKED.pop(t.req.rid, None)
    _PARKED.pop(t.req.rid, None)
    decode_sampling.forget(t.req.rid)
    side = _SIDE.get("side")
    if side is None:
        return
    if t.state.phase is Phase.NORMAL:
        side.forget(t.room)
    else:
        side.abort(t.room, f"request finished in phase {t.state.phase.name}")


def _around_update_finish_state(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(req, *args, **kwargs)
    t = _TRACKED.get(str(getattr(req, "rid", ""))) if _TRACKED else None
    if t is None or t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return result
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
            _truncate_to_verified(t)
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
    for path, hook, kind in (*SCHEDULER_HOOKS, *decode_sampling.SAMPLING_HOOKS):
        register(path, hook, kind)
