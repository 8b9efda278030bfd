"""What the decode scheduler hooks do to a parked Lynx request: upgrade, verify, recompute, fail.

Each action takes the decode server's :class:`~sglang_lynx.integration.decode.state.DecodeLynxState`
(``s``: its transport side, config, draft-law records, counters, verify GEMM policy) and the
request's :class:`~sglang_lynx.integration.decode.tracked.Tracked`, and leaves the request ready to
re-enter SGLang's prebuilt path (the caller re-admits it):

- :func:`upgrade_without_drafts`: the residual landed before any draft: the prompt KV is upgraded
  in place and the request decodes normally (0 drafts, phase NORMAL).
- :func:`verify` with ``mode="verify"``: upgrade, one chain pass over the drafts, greedy accept or
  speculative sampling (``decode.commit.verify_parked_request``); ``mode="recompute"`` (the fallback): the
  prompt KV rebuilt on the decode server as a prefill computes it, in ``--chunked-prefill-size`` passes
  (:func:`prefill_chunk`), then the same chain pass.
- :func:`fail`: policy ``fail``: the drafts are cut, the request finishes with a clear 500 error.
- :func:`fail_internal`: a Lynx step raised for this request (admission, upgrade, verify, fallback,
  the stream hook): the same as :func:`fail` with the error in the message (:func:`internal_error`);
  it never raises itself, so the server and the other requests go on.

Invariant: a draft is never released by any action; ``output_ids`` hold verified tokens only after it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import TRANSITIONS, Phase
from sglang_lynx.integration.decode.commit import SamplingVerify, verify_parked_request
from sglang_lynx.integration.decode.faults import raise_if_asked
from sglang_lynx.integration.decode.state import DecodeLynxState
from sglang_lynx.integration.decode.tracked import Tracked

logger = logging.getLogger("sglang_lynx.decode")


def landed_at(progress: Any, stream: str) -> float | None:
    """When the transport saw ``stream`` land (monotonic clock), None if unknown."""
    from sglang_lynx.transfer.streams import StreamKind

    inbound = progress.request
    if inbound is None:
        return None
    return inbound.landed_at.get(StreamKind(stream))  # type: ignore[no-any-return]


def note_full_kv(t: Tracked) -> None:
    """lynx-exact: when the full KV was restored and the share of its values restored ahead of the last
    landing (meta_info)."""
    t.state.full_ready_at = getattr(t.progress, "full_ready_at", None)
    restored = getattr(t.progress, "exact_restored", None)
    if restored is not None and restored[1]:
        t.state.exact_ahead = restored[0] / restored[1]


def upgrade_without_drafts(s: DecodeLynxState, t: Tracked) -> None:
    """Residual landed before any draft: upgrade the prompt KV in place, decode normally from here."""
    started = time.monotonic()
    t.state.residual_landed_at = landed_at(t.progress, "residual") or started
    note_full_kv(t)
    t.state.advance(Phase.VERIFYING)
    raise_if_asked(t.req, "upgrade")
    t.progress.upgrade_kv()
    seconds = time.monotonic() - started
    t.state.on_verified(0, len(t.req.output_ids), seconds, seconds)
    s.laws.forget(t.req.rid)
    s.side.forget(t.room)


def _late_reason(t: Tracked, config: LynxConfig) -> str:
    return t.progress.failure() or f"residual not landed {config.residual_timeout_s} s after the anchor"


def prefill_chunk(scheduler: Any) -> int | None:
    """The recompute's EXTEND pass length: this server's ``--chunked-prefill-size`` (the launch line a PD
    deployment gives both sides), None where it has none or chunking is off."""
    size = getattr(getattr(scheduler, "server_args", None), "chunked_prefill_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def verify(s: DecodeLynxState, t: Tracked, mode: str) -> None:
    started = time.monotonic()
    if mode == "verify" and t.state.num_drafts == 0:
        upgrade_without_drafts(s, t)
        return
    if mode == "verify":
        t.state.residual_landed_at = landed_at(t.progress, "residual") or started
        note_full_kv(t)
        t.state.advance(Phase.VERIFYING)
    else:
        reason = _late_reason(t, s.config)
        t.state.fallback = f"recompute ({reason})"
        t.state.advance(Phase.FALLBACK)
        s.side.abort(t.room, f"fallback to recompute: {reason}")
        s.counts.count("fallbacks", 1)
    sampling = None
    if not t.greedy:
        assert t.generator is not None
        drafts = list(t.req.output_ids[1:])
        sampling = SamplingVerify(t.req.sampling_params, s.laws.draft_probs_for(t.req.rid, drafts),
                                  t.generator)
        if drafts and sampling.draft_probs is None:
            logger.warning("lynx: %s: no exact record of the draft distributions; all %d drafts rejected",
                           t.req.rid, len(drafts))
    if mode == "verify":
        raise_if_asked(t.req, "upgrade")
        raise_if_asked(t.req, "verify")
    outcome = verify_parked_request(t.req, s.scheduler.tp_worker.model_runner, s.scheduler.tree_cache,
                                    t.progress, mode, sampling, s.config.verify_tie_margin, s.gemm,
                                    s.config.verify_first_pass, s.attention, s.config.verify_bonus_token,
                                    prefill_chunk(s.scheduler))
    t.state.num_bonus += int(outcome.bonus)
    s.laws.forget(t.req.rid)
    seconds = time.monotonic() - started
    if outcome.finished:
        # SGLang's prebuilt path must not see a finished request (it checkpoints its KV first): hand
        # the finish over as ``to_finish``, which the prebuilt result processing turns into the finish
        # (release + stream) exactly as for its own grammar aborts; finished_len stays as replayed
        t.req.to_finish, t.req.finished_reason = t.req.finished_reason, None
    if mode == "verify":
        t.state.on_verified(outcome.num_accepted, outcome.new_output_len, seconds, outcome.upgrade_s)
        s.side.forget(t.room)
    else:
        t.state.num_accepted += outcome.num_accepted
        t.state.num_verifies += 1
        t.state.verify_time_s += seconds
        t.state.upgrade_time_s += outcome.upgrade_s
        t.state.verified_output_len = outcome.new_output_len
        t.state.advance(Phase.NORMAL)
    s.counts.count("drafts", outcome.num_drafts)
    s.counts.count("accepted", outcome.num_accepted)
    s.counts.count("bonus", int(outcome.bonus))
    s.counts.count("verifies", 1)
    logger.info("lynx: %s %s: %d drafts, %d accepted, %d rows computed, %.3f s (upgrade %.3f s)%s", mode,
                t.req.rid, outcome.num_drafts, outcome.num_accepted, outcome.rows, seconds, outcome.upgrade_s,
                " (finished)" if outcome.finished else "")


def fail(s: DecodeLynxState, t: Tracked) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reason = _late_reason(t, s.config)
    message = f"sglang-lynx: the KV residual of this request did not arrive ({reason}); fallback policy 'fail'"
    t.state.failure = message
    t.state.advance(Phase.FAILED)
    truncate_to_verified(t)
    s.laws.forget(t.req.rid)
    t.req.to_finish = FINISH_ABORT(message, 500)
    s.side.abort(t.room, reason)
    s.counts.count("failed", 1)


def internal_error(rid: str, stage: str, exc: BaseException) -> str:
    """Log ``exc`` (raised in ``stage`` of request ``rid``) and return the client's error message."""
    logger.error("lynx: %s: internal error during %s; the request is aborted", rid, stage, exc_info=exc)
    return (f"sglang-lynx: internal error during {stage} of this request ({type(exc).__name__}: {exc}); "
            "the request was aborted, the server goes on")


def fail_internal(s: DecodeLynxState, t: Tracked, message: str) -> None:
    """Finish ``t``'s request with ``message`` (500, drafts cut); never raises."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    t.state.failure = message
    for phase in (Phase.FAILED, Phase.ABORTED):
        if phase in TRANSITIONS[t.state.phase]:
            t.state.advance(phase)
            break
    truncate_to_verified(t)
    s.laws.forget(t.req.rid)
    t.req.finished_reason, t.req.finished_len = None, None
    t.req.to_finish = FINISH_ABORT(message, 500)
    try:
        s.side.abort(t.room, message)
    except Exception:
        logger.exception("lynx: %s: releasing the Lynx transfer of a failed request raised", t.req.rid)
    s.counts.count("failed", 1)


def fail_untracked(s: DecodeLynxState, req: Any, room: int, message: str) -> None:
    """Admission raised before the request was tracked (its only output is the exact first token)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(message, 500)
    try:
        s.side.abort(room, message)
    except Exception:
        logger.exception("lynx: %s: releasing the Lynx transfer of a failed request raised", req.rid)
    s.counts.count("failed", 1)


def truncate_to_verified(t: Tracked) -> None:
    """Drop drafts from output_ids (their KV stays allocated and is released with the row)."""
    keep = t.state.verified_output_len
    if len(t.req.output_ids) > keep:
        del t.req.output_ids[keep:]
