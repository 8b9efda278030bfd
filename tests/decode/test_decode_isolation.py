"""Per-request isolation of the decode-scheduler hooks (fake scheduler tier, fakes from
test_decode_scheduler_fakes.py): a request whose Lynx handling raises (KV upgrade, verify,
admission, the stream hook) is failed with the reason in its error (FINISH_ABORT 500, drafts never
released) while the requests beside it and the server go on; the draft-law record is bounded."""

from __future__ import annotations

from typing import Any

import pytest
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
from sglang_lynx.integration.decode.sampling import DraftLaws


class UpgradeFails(FakeProgress):
    def upgrade_kv(self) -> None:
        raise RuntimeError("upgrade exploded: staging bytes unreadable")


def _next(scheduler: FakeScheduler, batch: FakeBatch) -> None:
    ds._around_next_batch(lambda s, b: None, scheduler, batch)


def _admit(scheduler: FakeScheduler, batch: FakeBatch) -> None:
    batch.reqs.extend(scheduler.waiting_queue)
    scheduler.waiting_queue.clear()


@pytest.fixture
def three(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Requests ok (row 0), up (its KV upgrade raises, row 1), ver (its verify pass raises, row 2)."""
    side = FakeSide(LynxConfig(mode="lynx", max_draft_tokens=2))
    side.inbound = {10: FakeProgress(), 11: UpgradeFails(), 12: FakeProgress()}
    scheduler = FakeScheduler(side)
    reqs = {name: FakeReq(name, room, [1, 2, 3, 4], [5], FakeKV(room - 10, 4, 4))
            for name, room in (("ok", 10), ("up", 11), ("ver", 12))}
    scheduler.waiting_queue.extend(reqs.values())

    def fake_verify(model_runner: Any, row: int, prefix_len: int, token_ids: list[int], *rest: Any,
                   **kw: Any) -> torch.Tensor:
        if row == 2:
            raise torch.cuda.OutOfMemoryError("verify pass out of memory")
        logits = torch.zeros(len(token_ids), VOCAB)
        logits[:, 7] = 1.0
        return logits

    monkeypatch.setattr(decode_commit, "chain_verify_logits", fake_verify)
    monkeypatch.setattr(decode_commit, "reserve_bonus_slot", reserve_bonus_slot)
    yield scheduler, side, reqs


def _draft_to_cap_and_land(scheduler: FakeScheduler, side: FakeSide) -> FakeBatch:
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    for _ in range(2):
        _next(scheduler, batch)
        batch.decode_step()
    _next(scheduler, batch)  # all three at the draft cap: parked
    assert batch.reqs == [] and set(lynx(scheduler).parked) == {"ok", "up", "ver"}
    for progress in side.inbound.values():
        progress.residual = True
    _next(scheduler, batch)
    return batch


def _assert_failed(scheduler: FakeScheduler, req: FakeReq, side: FakeSide, text: str) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    assert isinstance(req.to_finish, FINISH_ABORT) and req.to_finish.status_code == 500
    assert "internal error" in req.to_finish.message and text in req.to_finish.message
    assert req.output_ids == [5]  # the drafts are never released
    assert lynx(scheduler).tracked[req.rid].state.phase is Phase.FAILED
    assert any(room == req.bootstrap_room and text in why for room, why in side.aborted)


def test_a_raising_upgrade_and_a_raising_verify_fail_only_their_requests(three) -> None:  # noqa: ANN001
    scheduler, side, reqs = three
    _draft_to_cap_and_land(scheduler, side)
    ok = lynx(scheduler).tracked["ok"].state
    assert reqs["ok"].output_ids == [5, 7, 7, 7] and ok.phase is Phase.NORMAL and ok.num_accepted == 2  # + bonus
    assert reqs["ok"].to_finish is None
    _assert_failed(scheduler, reqs["up"], side, "upgrade exploded")
    _assert_failed(scheduler, reqs["ver"], side, "verify pass out of memory")
    assert "verify" in reqs["ver"].to_finish.message
    assert scheduler.waiting_queue == [reqs["ok"], reqs["up"], reqs["ver"]]  # SGLang releases/finishes them
    assert not lynx(scheduler).parked
    # SGLang turns to_finish into the finish and streams it: only the verified first token goes out
    streamed: dict[str, int] = {}
    for req in (reqs["up"], reqs["ver"]):
        req.finished_reason, req.to_finish = req.to_finish, None
        dst._around_accept(lambda acc, *, req: streamed.__setitem__(req.rid, len(req.output_ids)), None, req=req)
    assert streamed == {"up": 1, "ver": 1} and not {"up", "ver"} & set(lynx(scheduler).tracked)
    # the server goes on: the healthy request keeps decoding, a new one is tracked and verified
    batch = FakeBatch([])
    _admit(scheduler, batch)
    side.inbound[13] = FakeProgress(residual=True)
    new = FakeReq("new", 13, [1, 2], [5], FakeKV(3, 2, 2))
    scheduler.waiting_queue.append(new)
    _next(scheduler, batch)
    assert lynx(scheduler).tracked["new"].state.phase is Phase.NORMAL and side.inbound[13].upgrades == 1


def test_an_upgrade_that_raises_at_admission_fails_that_request_only(three) -> None:  # noqa: ANN001
    scheduler, side, reqs = three
    side.inbound[11].residual = True  # "up" is admitted with its residual there: upgraded at once, raises
    side.inbound[10].residual = True
    _next(scheduler, FakeBatch([]))
    _assert_failed(scheduler, reqs["up"], side, "upgrade exploded")
    assert "admission" in reqs["up"].to_finish.message
    tracked = lynx(scheduler).tracked
    assert tracked["ok"].state.phase is Phase.NORMAL and tracked["ver"].state.phase is Phase.DRAFTING
    assert scheduler.waiting_queue == [reqs["ok"], reqs["up"], reqs["ver"]]
    _next(scheduler, FakeBatch([]))  # the failed request is not tracked again
    assert side.inbound[10].upgrades == 1 and reqs["up"].output_ids == [5]


def test_a_raising_stream_hook_withholds_and_fails_that_request(three, monkeypatch) -> None:  # noqa: ANN001
    scheduler, side, reqs = three
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    _next(scheduler, batch)
    batch.decode_step()  # every request holds one draft
    monkeypatch.setattr(lynx(scheduler).tracked["ver"].state, "releasable_output_len",
                        lambda n: (_ for _ in ()).throw(ValueError("bookkeeping bug")))
    streamed: list[tuple[str, int]] = []

    def accept(acc: Any, *, req: FakeReq) -> None:
        streamed.append((req.rid, len(req.output_ids)))

    for req in batch.reqs:
        dst._around_accept(accept, None, req=req)
    assert streamed == []  # drafts withheld, the raising request's too
    _next(scheduler, batch)  # the raising request is parked and failed; the others keep drafting
    assert [r.rid for r in batch.reqs] == ["ok", "up"]
    _assert_failed(scheduler, reqs["ver"], side, "bookkeeping bug")
    assert "streaming" in reqs["ver"].to_finish.message and scheduler.waiting_queue == [reqs["ver"]]


def test_an_error_outside_any_request_leaves_the_batch_running(three) -> None:  # noqa: ANN001
    scheduler, side, reqs = three
    scheduler.disagg_decode_prealloc_queue = None  # the transport cannot be found at all
    ran = []
    ds._around_next_batch(lambda s, b: ran.append(b), scheduler, "batch")
    assert ran == ["batch"]


def test_the_draft_law_record_is_bounded_and_exact() -> None:
    laws = DraftLaws()
    laws.watch("r", max_rows=3)
    sparse = torch.zeros(1000)
    sparse[[3, 7, 500]] = torch.tensor([0.5, 0.25, 0.25])
    dense = torch.softmax(torch.randn(1000), dim=0)
    record = laws.records["r"]
    record.add(7, sparse)
    record.add(3, dense)
    assert record.nbytes() == 3 * 8 + 1000 * 4  # the truncated law keeps its 3 entries only
    rows = laws.draft_probs_for("r", [7, 3])
    assert rows is not None and torch.equal(rows[0], sparse) and torch.equal(rows[1], dense)  # bit for bit
    record.add(9, dense)
    record.add(9, dense)  # a 4th row: more than the window allows, the record is dropped
    assert record.overflowed and record.nbytes() == 0 and laws.draft_probs_for("r", [7, 3, 9, 9]) is None
    laws.watch("kept")
    laws.retain({"kept": object()})  # requests no longer tracked lose their record
    assert set(laws.records) == {"kept"}
