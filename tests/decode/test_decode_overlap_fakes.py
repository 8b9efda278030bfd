"""The decode-scheduler hooks on SGLang's overlap loop, with the fakes of ``test_decode_scheduler_fakes``
(extra unit tier; the real overlap loop runs in ``test_lynx_pd_speculative.py`` and
``test_lynx_bf16_lossless.py``).

:class:`OverlapLoop` steps the fakes the way ``event_loop_overlap_disagg_decode`` does: the batch
hook, then the launch of batch i (a KV slot per request, the batch kept in ``result_queue``), then
the result of batch i-1 processed (a token appended, the finish check through the Lynx hook). What
is checked: the hold and cap counts include the pending token (exactly k drafts), a max-tokens finish
is foreseen, nothing happens to a parked request while a batch of it is in flight (verify sees
consistent KV bookkeeping), and an abort in that window is deferred, not lost.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from test_decode_scheduler_fakes import FakeBatch, FakeReq, _admit, _next, lynx, setup  # noqa: F401

from sglang_lynx.decode.state import Phase
from sglang_lynx.integration.decode import scheduler as ds
from sglang_lynx.integration.decode import streaming as dst
from sglang_lynx.integration.decode.tracked import HOLD_RESIDUAL_KEY, TEST_HOOKS_ENV


class OverlapLoop:
    """One fake scheduler driven like SGLang's overlap decode loop (module docstring)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.batch = FakeBatch([])
        scheduler.result_queue = deque()
        self.launched: list[list[str]] = []  # rids of each launched batch

    def step(self, token: int = 7) -> None:
        _next(self.scheduler, self.batch)
        _admit(self.scheduler, self.batch)  # the prebuilt path merges re-admitted requests
        self.batch.reqs = [r for r in self.batch.reqs if not r.finished() and r.to_finish is None]
        queue = self.scheduler.result_queue
        if self.batch.reqs:
            for r in self.batch.reqs:  # prepare_for_decode: one KV slot for the input token
                r.kv.kv_allocated_len += 1
                r.kv.kv_committed_len += 1
            queue.append((FakeBatch(self.batch.reqs), token))
            self.launched.append([r.rid for r in self.batch.reqs])
        if len(queue) > (1 if self.batch.reqs else 0):
            done, result = queue.popleft()
            for r in done.reqs:
                if r.finished():
                    continue  # SGLang skips a finished request's overshoot token
                r.output_ids.append(result)
                dst._around_update_finish_state(FakeReq.update_finish_state, r)


@pytest.fixture
def hooks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")


def _bookkeeping_ok(req: FakeReq) -> bool:
    """KV for every position but the last output token (what verify asserts)."""
    return req.kv.kv_allocated_len == len(req.origin_input_ids) + len(req.output_ids) - 1


def test_cap_counts_the_pending_token_and_verify_waits_for_the_result(setup) -> None:  # noqa: ANN001, F811
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=3, residual_timeout_s=3600.0)
    loop = OverlapLoop(scheduler)
    for _ in range(4):
        loop.step()
    # 3 drafts launched (the third still unprocessed when the cap parked it): exactly the cap
    assert loop.launched == [["r1"]] * 3 and "r1" in lynx(scheduler).parked
    assert list(req.output_ids) == [5, 7, 7, 7] and _bookkeeping_ok(req)
    assert not calls
    progress.residual = True
    loop.step()
    assert calls == [(4, [5, 7, 7, 7])]  # t0, the drafts, and the last draft as the bonus row's input
    state = lynx(scheduler).tracked["r1"].state
    assert state.phase is Phase.NORMAL and (state.num_drafts, state.num_accepted, state.num_bonus) == (3, 3, 1)
    assert list(req.output_ids) == [5, 7, 7, 7, 7]  # the bonus 7; re-admitted and in the next batch already


def test_verify_never_runs_while_a_batch_of_the_request_is_in_flight(setup) -> None:  # noqa: ANN001, F811
    """The residual lands mid-draft: parked at once, verified only after its last batch's result."""
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=64, residual_timeout_s=3600.0)
    loop = OverlapLoop(scheduler)
    loop.step()
    loop.step()
    progress.residual = True
    seen: list[tuple[int, bool]] = []
    real = ds.decode_actions.verify

    def watched(s: Any, t: Any, mode: str) -> None:
        queued = any(t.req in b.reqs for b, _ in scheduler.result_queue)
        seen.append((len(t.req.output_ids), queued))
        real(s, t, mode)

    ds.decode_actions.verify = watched  # type: ignore[assignment]
    try:
        loop.step()  # parked: out of the batch being built, its last batch still queued
        assert "r1" in lynx(scheduler).parked and not seen
        loop.step()
    finally:
        ds.decode_actions.verify = real  # type: ignore[assignment]
    assert seen == [(3, False)] and calls == [(4, [5, 7, 7])]
    assert lynx(scheduler).tracked["r1"].state.num_drafts == 2


@pytest.mark.parametrize("hold", [1, 2, 5])
def test_hold_k_gives_exactly_k_drafts(setup, hooks_on: None, hold: int) -> None:  # noqa: ANN001, F811
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=64, residual_timeout_s=3600.0)
    req.sampling_params.custom_params = {HOLD_RESIDUAL_KEY: hold}
    progress.residual = True  # landed at once; the hold lets it count only after k drafts
    loop = OverlapLoop(scheduler)
    for _ in range(hold + 3):
        loop.step()
    state = lynx(scheduler).tracked["r1"].state
    assert state.phase is Phase.NORMAL and state.num_drafts == hold, state
    # every draft accepted: the verify's passes of 4, then 8 inputs (verify_first_pass); the last pass also
    # takes the bonus row (input: the last draft)
    inputs = [5, *[7] * hold]
    assert calls == ([(4, inputs[:4]), (8, inputs[4:])] if hold > 4 else [(4, inputs)])


def test_a_max_tokens_finish_is_foreseen_one_step_early(setup, hooks_on: None) -> None:  # noqa: ANN001, F811
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=64, residual_timeout_s=3600.0)
    req.sampling_params.max_new_tokens = 4
    req.sampling_params.custom_params = {HOLD_RESIDUAL_KEY: 64}
    progress.residual = True
    loop = OverlapLoop(scheduler)
    for _ in range(6):
        loop.step()
    # three drafts (output 4 = max_new_tokens), no overshoot past the finish
    assert calls == [(4, [5, 7, 7])] and sum(len(b) for b in loop.launched) == 3
    assert req.to_finish is not None and list(req.output_ids) == [5, 7, 7, 7]


def test_an_abort_while_the_parked_request_is_in_flight_is_deferred(setup) -> None:  # noqa: ANN001, F811
    configure, _ = setup
    scheduler, side, req, progress = configure(max_draft_tokens=2, residual_timeout_s=3600.0)
    loop = OverlapLoop(scheduler)
    for _ in range(2):
        loop.step()
    _next(scheduler, loop.batch)  # parked at the cap; the batch of its second draft is still queued
    assert "r1" in lynx(scheduler).parked and any(req in b.reqs for b, _ in scheduler.result_queue)
    seen: list[list[FakeReq]] = []
    abort = type("AbortReq", (), {"abort_all": False, "rid": "r1"})()
    ds._around_abort_request(lambda s, r: seen.append(list(s.waiting_queue)), scheduler, abort)
    assert seen == [[]] and lynx(scheduler).tracked["r1"].abort_requested  # not released under the batch
    done, token = scheduler.result_queue.popleft()  # SGLang processes that result
    for r in done.reqs:
        r.output_ids.append(token)
    _next(scheduler, loop.batch)
    assert scheduler.waiting_queue == [req] and list(req.output_ids) == [5]
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    assert isinstance(req.to_finish, FINISH_ABORT)  # the prebuilt path releases the row and streams it
    assert lynx(scheduler).tracked["r1"].state.phase is Phase.ABORTED and "r1" not in lynx(scheduler).parked


def test_a_held_residual_that_landed_is_never_late(setup, hooks_on: None,  # noqa: ANN001, F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow host takes longer than ``residual_timeout_s`` for k held drafts: still k drafts and a
    verify, not the recompute fallback (the residual is there; only the test hold withholds it)."""
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=64, residual_timeout_s=0.001)
    req.sampling_params.custom_params = {HOLD_RESIDUAL_KEY: 3}
    progress.residual = True
    loop = OverlapLoop(scheduler)
    loop.step()
    monkeypatch.setattr(ds.time, "monotonic", lambda: 1e12)  # long after the deadline
    for _ in range(5):
        loop.step()
    state = lynx(scheduler).tracked["r1"].state
    assert state.fallback is None and state.phase is Phase.NORMAL and state.num_drafts == 3
    assert calls == [(4, [5, 7, 7, 7])]
