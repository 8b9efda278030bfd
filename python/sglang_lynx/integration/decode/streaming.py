"""The decode-scheduler hooks that see only a request: streaming and finishing (mode ``lynx``).

Both find the request's decode server through the request (``decode.state.tracked_of``: a tracked
``Req`` carries its ``DecodeLynxState``); a request no Lynx state tracks passes through untouched.

- AROUND ``_GenerationStreamAccumulator.accept``: tokens beyond the verified count (drafts) are
  withheld from the streamer; a finished request is dropped from its state (``DecodeLynxState.done``)
  and its ``lynx_*`` fields are written into ``req.customized_info`` (one value per output token),
  with ``lynx_pool_free_tokens`` and ``lynx_server_counts`` (that server's totals) at the finish.
  An exception here fails that request only (never streams what may be a draft).
- AROUND ``Req.update_finish_state``: a non-abort finish (EOS, stop, max tokens) on a draft is undone
  while drafting (``finish_undone``: the request is parked, verify replays the finish).
"""

from __future__ import annotations

from typing import Any

from sglang_lynx.decode.state import Phase
from sglang_lynx.integration.decode import actions as decode_actions
from sglang_lynx.integration.decode.state import DecodeLynxState, tracked_of
from sglang_lynx.integration.decode.tracked import Tracked


def _around_accept(original: Any, accumulator: Any, *, req: Any) -> Any:
    found = tracked_of(req)
    if found is None:
        return original(accumulator, req=req)
    s, t = found
    try:
        release = _before_accept(s, t, req)
    except Exception as exc:  # this request only: never stream what may be a draft
        message = decode_actions.internal_error(req.rid, "streaming", exc)
        release = req.finished()
        if release:  # finishing anyway: cut to verified tokens and let SGLang stream the end
            decode_actions.truncate_to_verified(t)
            s.done(t)
        else:
            t.internal_error = message  # parked and failed before the next batch
    return original(accumulator, req=req) if release else None


def _before_accept(s: DecodeLynxState, t: Tracked, req: Any) -> bool:
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
        s.done(t, residual_may_land=in_flight)
    elif len(req.output_ids) > t.state.releasable_output_len(len(req.output_ids)):
        return False  # drafts: never streamed
    info: dict[str, Any] = dict(t.state.meta_info())
    if req.finished():  # leak checks: free pool tokens when this one is done
        info["lynx_pool_free_tokens"] = int(s.scheduler.token_to_kv_pool_allocator.available_size())
        info["lynx_server_counts"] = s.counts.snapshot()
    req.customized_info = {k: [v] * len(req.output_ids) for k, v in info.items()}
    return True


def _finished_on_verified(t: Tracked) -> bool:
    """The request finished (not by abort) with no draft in ``output_ids``: a verified token ended it."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return (len(t.req.output_ids) <= t.state.verified_output_len
            and not isinstance(t.req.finished_reason, FINISH_ABORT))


def _around_update_finish_state(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(req, *args, **kwargs)
    found = tracked_of(req)
    if found is None:
        return result
    t = found[1]
    if t.state.phase not in (Phase.DRAFTING, Phase.WAITING_RESIDUAL):
        return result
    if len(req.output_ids) <= t.state.verified_output_len:
        return result  # the finish is on a verified token (the first one, from the prefill): it stands
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN

    if isinstance(req.finished_reason, (FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN)):
        req.finished_reason = None  # decided after verification (replayed token by token)
        req.finished_len = None
        t.finish_undone = True
    return result


STREAMING_HOOKS = (
    ("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
     _around_accept, "around"),
    ("sglang.srt.managers.schedule_batch.Req.update_finish_state", _around_update_finish_state, "around"),
)
