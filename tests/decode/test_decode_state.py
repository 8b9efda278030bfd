"""Lynx state belongs to the scheduler it serves (``integration/decode/state.py``), fake tier: two
decode schedulers in one process track a request of the same rid each, with different configs and
transports, and each request gets its own server's outcome (one fails by the ``fail`` policy, the
other is verified), its own counters, its own parked set and its own streaming."""

from __future__ import annotations

from typing import Any

import torch
from test_decode_scheduler_fakes import (
    VOCAB,
    FakeBatch,
    FakeKV,
    FakeProgress,
    FakeReq,
    FakeScheduler,
    FakeSide,
    lynx,
    reserve_bonus_slot,
)

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import Phase
from sglang_lynx.integration.decode import commit as decode_commit
from sglang_lynx.integration.decode import scheduler as ds
from sglang_lynx.integration.decode import streaming as dst


def _next(scheduler: FakeScheduler, batch: FakeBatch) -> None:
    ds._around_next_batch(lambda s, b: None, scheduler, batch)


def _server(**config: Any) -> tuple[FakeScheduler, FakeSide, FakeReq, FakeBatch]:
    side = FakeSide(LynxConfig(mode="lynx", **config))
    side.inbound[11] = FakeProgress()
    scheduler = FakeScheduler(side)
    req = FakeReq("same", 11, [1, 2, 3, 4], [5], FakeKV(0, 4, 4))
    scheduler.waiting_queue.append(req)
    return scheduler, side, req, FakeBatch([])


def test_two_schedulers_in_one_process_do_not_see_each_others_requests(monkeypatch) -> None:  # noqa: ANN001
    def agree_with_7(model_runner: Any, row: int, prefix_len: int, token_ids: list[int], *rest: Any,
                   **kw: Any) -> torch.Tensor:
        logits = torch.zeros(len(token_ids), VOCAB)
        logits[:, 7] = 1.0
        return logits

    monkeypatch.setattr(decode_commit, "chain_verify_logits", agree_with_7)
    monkeypatch.setattr(decode_commit, "reserve_bonus_slot", reserve_bonus_slot)
    a, a_side, ra, batch_a = _server(max_draft_tokens=2, fallback="fail")
    b, b_side, rb, batch_b = _server(max_draft_tokens=3)
    _next(a, batch_a)
    _next(b, batch_b)
    assert lynx(a) is not lynx(b)
    assert lynx(a).tracked["same"].req is ra and lynx(b).tracked["same"].req is rb  # same rid, both tracked
    for scheduler, batch in ((a, batch_a), (b, batch_b)):
        batch.reqs.extend(scheduler.waiting_queue)
        scheduler.waiting_queue.clear()
    for _ in range(3):
        _next(a, batch_a)
        _next(b, batch_b)
        batch_a.decode_step()
        batch_b.decode_step()
    # a is at its cap of 2 drafts and parked; b (cap 3) drafted on
    assert batch_a.reqs == [] and set(lynx(a).parked) == {"same"} and batch_b.reqs == [rb] and not lynx(b).parked
    assert ra.output_ids == [5, 7, 7] and rb.output_ids == [5, 7, 7, 7]
    assert ds._around_is_fully_idle(lambda s: True, a) is False and ds._around_is_fully_idle(lambda s: True, b)
    a_side.inbound[11].failed = "checksum mismatch on the residual"  # a's residual fails, b's lands
    b_side.inbound[11].residual = True
    _next(a, batch_a)
    _next(b, batch_b)
    a_state, b_state = lynx(a).tracked["same"].state, lynx(b).tracked["same"].state
    assert a_state.phase is Phase.FAILED and ra.output_ids == [5] and "fail" in ra.to_finish.message
    assert b_state.phase is Phase.NORMAL and (b_state.num_drafts, b_state.num_accepted) == (3, 3)
    assert rb.output_ids == [5, 7, 7, 7, 7] and rb.to_finish is None  # 3 drafts and the bonus
    assert a_side.aborted and a_side.aborted[0][0] == 11 and not b_side.aborted and b_side.forgotten == [11]
    assert (lynx(a).counts.snapshot()["failed"], lynx(b).counts.snapshot()["failed"]) == (1, 0)
    assert (lynx(a).counts.snapshot()["accepted"], lynx(b).counts.snapshot()["accepted"]) == (0, 3)
    # streaming finds each request's own server: a's ends with its verified token, b's streams its 4
    streamed: list[tuple[str, int]] = []

    def accept(acc: Any, *, req: FakeReq) -> None:
        streamed.append((req.rid, len(req.output_ids)))

    ra.finished_reason, ra.to_finish = ra.to_finish, None
    dst._around_accept(accept, None, req=ra)
    assert "same" not in lynx(a).tracked and "same" in lynx(b).tracked
    dst._around_accept(accept, None, req=rb)
    assert streamed == [("same", 1), ("same", 5)]  # t0, 3 drafts and the bonus
    assert ra.customized_info["lynx_server_counts"][0]["failed"] == 1
    assert rb.customized_info["lynx_phase"][0] == "normal"
