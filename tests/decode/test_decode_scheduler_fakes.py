"""The decode-scheduler hooks' decisions with a fake scheduler, batch and transport (extra unit
tier; the real thing runs in test_lynx_pd_speculative.py): admission with the residual already
there, drafting to the cap, parking, verify and re-admission, the 'fail' and 'recompute' policies,
abort of a parked request, and withholding drafts from the streamer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import Phase
from sglang_lynx.integration.decode import commit as decode_commit
from sglang_lynx.integration.decode import scheduler as ds
from sglang_lynx.integration.decode import streaming as dst
from sglang_lynx.integration.decode.state import DecodeLynxState

VOCAB = 32


@dataclass
class FakeProgress:
    residual: bool = False
    failed: str | None = None
    upgrades: int = 0
    request: Any = None

    def anchor_landed(self) -> bool:
        return True

    def residual_landed(self) -> bool:
        return self.residual

    def full_kv_ready(self) -> bool:
        return self.residual

    def failure(self) -> str | None:
        return self.failed

    def upgrade_kv(self) -> None:
        self.upgrades += 1


class FakeTracker:
    def expire(self) -> None:
        pass


@dataclass
class FakeSide:
    config: LynxConfig = field(default_factory=lambda: LynxConfig(mode="lynx"))
    inbound: dict[int, FakeProgress] = field(default_factory=dict)
    forgotten: list[int] = field(default_factory=list)
    aborted: list[tuple[int, str]] = field(default_factory=list)
    tracker: FakeTracker = field(default_factory=FakeTracker)

    def forget(self, room: int) -> None:
        self.forgotten.append(room)

    def abort(self, room: int, reason: str = "") -> None:
        self.aborted.append((room, reason))


@dataclass
class FakeKV:
    req_pool_idx: int
    kv_allocated_len: int
    kv_committed_len: int


@dataclass
class FakeParams:
    top_k: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    sampling_seed: int | None = None
    max_new_tokens: int = 100
    custom_params: dict[str, Any] | None = None


@dataclass
class FakeReq:
    rid: str
    bootstrap_room: int
    origin_input_ids: list[int]
    output_ids: list[int]
    kv: FakeKV
    sampling_params: FakeParams = field(default_factory=FakeParams)
    finished_reason: Any = None
    finished_len: int | None = None
    to_finish: Any = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        if len(self.output_ids) >= self.sampling_params.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(self.sampling_params.max_new_tokens)


class FakeBatch:
    def __init__(self, reqs: list[FakeReq]) -> None:
        self.reqs = list(reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def filter_batch(self, reqs_to_exclude: list[FakeReq]) -> None:
        self.reqs = [r for r in self.reqs if r not in reqs_to_exclude]

    def decode_step(self, token: int = 7) -> None:
        for r in self.reqs:
            r.output_ids.append(token)
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1


class FakeAllocator:
    def available_size(self) -> int:
        return 1000


class FakeTreeCache:
    def __init__(self) -> None:
        self.freed: list[tuple[int, int]] = []

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        self.freed.extend(ranges)


class FakeScheduler:
    def __init__(self, side: FakeSide) -> None:
        kv_manager = type("KVM", (), {"lynx": side})()
        self.disagg_decode_prealloc_queue = type("Q", (), {"kv_manager": kv_manager})()
        self.waiting_queue: list[FakeReq] = []
        self.tp_worker = type("W", (), {"model_runner": None})()
        self.tree_cache = FakeTreeCache()
        self.token_to_kv_pool_allocator = FakeAllocator()


def reserve_bonus_slot(req: FakeReq, model_runner: Any, tree_cache: Any) -> bool:
    """The bonus row's slot (``decode.bonus_slot``) as the fakes allocate it: the row grows by one."""
    req.kv.kv_allocated_len += 1
    req.kv.kv_committed_len += 1
    return True


def _next(scheduler: FakeScheduler, batch: FakeBatch) -> None:
    ds._around_next_batch(lambda s, b: None, scheduler, batch)


def lynx(scheduler: FakeScheduler) -> DecodeLynxState:
    """The Lynx state the hooks keep on ``scheduler`` (created by its first batch hook)."""
    state = scheduler._lynx  # type: ignore[attr-defined]
    assert isinstance(state, DecodeLynxState)
    return state


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def configure(**config: Any) -> tuple[FakeScheduler, FakeSide, FakeReq, FakeProgress]:
        side = FakeSide(LynxConfig(mode="lynx", **config))
        progress = FakeProgress()
        side.inbound[11] = progress
        scheduler = FakeScheduler(side)
        req = FakeReq("r1", 11, [1, 2, 3, 4], [5], FakeKV(0, 4, 4))
        scheduler.waiting_queue.append(req)
        return scheduler, side, req, progress

    calls: list[tuple[int, list[int]]] = []

    def fake_verify(model_runner: Any, row: int, prefix_len: int, token_ids: list[int],
                    gemm: Any = None, last_rows: Any = None, attention: Any = None) -> torch.Tensor:
        calls.append((prefix_len, list(token_ids)))
        logits = torch.zeros(len(token_ids), VOCAB)
        logits[:, 7] = 1.0  # the target agrees with drafts of token 7
        return logits

    def fake_prefill(model_runner: Any, row: int, prompt: list[int], chunk: Any) -> int:
        calls.append((0, list(prompt)))  # the recompute's prompt passes, from position 0
        return 1

    monkeypatch.setattr(decode_commit, "chain_verify_logits", fake_verify)
    monkeypatch.setattr(decode_commit, "prefill_prompt_kv", fake_prefill)
    monkeypatch.setattr(decode_commit, "reserve_bonus_slot", reserve_bonus_slot)
    yield configure, calls


def _admit(scheduler: FakeScheduler, batch: FakeBatch) -> None:
    """What SGLang's prebuilt path does with the waiting queue."""
    batch.reqs.extend(scheduler.waiting_queue)
    scheduler.waiting_queue.clear()


def test_residual_already_landed_upgrades_without_drafts(setup) -> None:  # noqa: ANN001
    configure, calls = setup
    scheduler, side, req, progress = configure()
    progress.residual = True
    _next(scheduler, FakeBatch([]))
    t = lynx(scheduler).tracked["r1"]
    assert t.state.phase is Phase.NORMAL and progress.upgrades == 1 and side.forgotten == [11]
    assert scheduler.waiting_queue == [req] and not calls


def test_draft_to_cap_park_verify_readmit(setup) -> None:  # noqa: ANN001
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=3)
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    for _ in range(3):
        _next(scheduler, batch)
        assert batch.reqs == [req]
        batch.decode_step()
    _next(scheduler, batch)  # cap reached: parked
    assert batch.reqs == [] and "r1" in lynx(scheduler).parked
    assert lynx(scheduler).tracked["r1"].state.phase is Phase.WAITING_RESIDUAL
    _next(scheduler, batch)  # still waiting
    assert "r1" in lynx(scheduler).parked and not calls
    progress.residual = True
    _next(scheduler, batch)
    assert calls == [(4, [5, 7, 7, 7])]  # one pass over t0, the drafts and the bonus row (the last draft)
    assert req.output_ids == [5, 7, 7, 7, 7] and scheduler.waiting_queue == [req]  # 3 drafts + the bonus
    state = lynx(scheduler).tracked["r1"].state
    assert state.phase is Phase.NORMAL and (state.num_drafts, state.num_accepted, state.num_bonus) == (3, 3, 1)
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 4 + 4  # KV up to the last draft's input
    assert side.forgotten == [11] and progress.upgrades == 1


def test_failed_residual_with_fail_policy_aborts_without_drafts(setup) -> None:  # noqa: ANN001
    configure, _ = setup
    scheduler, side, req, progress = configure(max_draft_tokens=2, fallback="fail")
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    _next(scheduler, batch)
    batch.decode_step()
    progress.failed = "checksum mismatch on the residual"
    _next(scheduler, batch)
    assert req.output_ids == [5]  # the draft is never released
    assert "checksum mismatch" in req.to_finish.message and "fail" in req.to_finish.message
    assert scheduler.waiting_queue == [req] and side.aborted and side.aborted[0][0] == 11
    assert lynx(scheduler).tracked["r1"].state.phase is Phase.FAILED


def test_late_residual_with_recompute_policy(setup, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=2, residual_timeout_s=0.001)
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    monkeypatch.setattr(ds.time, "monotonic", lambda: 1e12)  # long after the deadline
    _next(scheduler, batch)
    assert calls == [(0, [1, 2, 3, 4])]  # prompt recomputed from token ids, from position 0
    state = lynx(scheduler).tracked["r1"].state
    assert state.phase is Phase.NORMAL and str(state.fallback).startswith("recompute")
    assert progress.upgrades == 0 and side.aborted


def test_abort_of_a_parked_request_goes_through_the_waiting_queue(setup) -> None:  # noqa: ANN001
    configure, _ = setup
    scheduler, side, req, progress = configure(max_draft_tokens=1)
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    _next(scheduler, batch)
    batch.decode_step()
    _next(scheduler, batch)
    assert "r1" in lynx(scheduler).parked
    seen: list[list[FakeReq]] = []
    abort = type("AbortReq", (), {"abort_all": False, "rid": "r1"})()
    ds._around_abort_request(lambda s, r: seen.append(list(s.waiting_queue)), scheduler, abort)
    assert seen == [[req]] and req.output_ids == [5]
    assert not lynx(scheduler).parked and "r1" not in lynx(scheduler).tracked


def test_streamer_never_sees_drafts(setup) -> None:  # noqa: ANN001
    configure, _ = setup
    scheduler, side, req, progress = configure(max_draft_tokens=4)
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    streamed: list[int] = []

    def accept(acc: Any, *, req: FakeReq) -> None:
        streamed.append(len(req.output_ids))

    dst._around_accept(accept, None, req=req)
    batch.decode_step()
    dst._around_accept(accept, None, req=req)
    assert streamed == [1]  # the exact first token only; the draft was withheld
    progress.residual = True
    _next(scheduler, batch)
    dst._around_accept(accept, None, req=req)
    assert streamed == [1, 3] and req.customized_info["lynx_drafts"] == [1, 1, 1]  # the draft and the bonus


def test_finish_undone_while_drafting_parks(setup) -> None:  # noqa: ANN001
    configure, _ = setup
    scheduler, side, req, progress = configure()
    req.sampling_params.max_new_tokens = 2
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    _next(scheduler, batch)
    batch.decode_step()
    dst._around_update_finish_state(FakeReq.update_finish_state, req)
    assert not req.finished() and lynx(scheduler).tracked["r1"].finish_undone
    _next(scheduler, batch)
    assert batch.reqs == [] and "r1" in lynx(scheduler).parked


def test_a_finish_found_by_verification_is_handed_over_as_to_finish(setup) -> None:  # noqa: ANN001
    """SGLang's prebuilt path asserts the request is not finished: the replayed finish travels as
    ``to_finish`` (like SGLang's own grammar aborts), with output_ids cut at the finish."""
    configure, _ = setup
    scheduler, side, req, progress = configure()
    req.sampling_params.max_new_tokens = 3
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    for _ in range(3):
        _next(scheduler, batch)
        batch.decode_step()
        dst._around_update_finish_state(FakeReq.update_finish_state, req)
    progress.residual = True
    _next(scheduler, batch)
    assert scheduler.waiting_queue == [req] and not req.finished()
    assert req.to_finish is not None and list(req.output_ids) == [5, 7, 7]


@pytest.mark.parametrize("recorded", [False, True])
def test_sampling_request_drafts_and_is_verified_by_speculative_sampling(setup, recorded: bool) -> None:  # noqa: ANN001
    configure, calls = setup
    scheduler, side, req, progress = configure(max_draft_tokens=3)
    req.sampling_params = FakeParams(top_k=1 << 30, temperature=1.0, sampling_seed=5)
    batch = FakeBatch([])
    _next(scheduler, batch)
    # drafts, law recorded
    assert "r1" in lynx(scheduler).laws.records and lynx(scheduler).tracked["r1"].blocker is None
    _admit(scheduler, batch)
    for _ in range(3):
        _next(scheduler, batch)
        batch.decode_step()
    if recorded:  # what the sampler hook would have recorded: drafts sampled from a one-hot law
        lynx(scheduler).laws.records["r1"].tokens = [7, 7, 7]
        lynx(scheduler).laws.records["r1"].probs = [torch.nn.functional.one_hot(torch.tensor(7), VOCAB).float()] * 3
    progress.residual = True
    _next(scheduler, batch)
    state = lynx(scheduler).tracked["r1"].state
    assert calls == [(4, [5, 7, 7, 7])] and state.phase is Phase.NORMAL and state.num_drafts == 3
    assert 0 <= state.num_accepted <= 3 and len(req.output_ids) == 1 + state.num_accepted + 1  # + fix or bonus
    assert state.num_bonus == (state.num_accepted == 3)
    if not recorded:
        assert state.num_accepted == 0  # no exact record: every draft rejected, position 1 drawn from p
    assert "r1" not in lynx(scheduler).laws.records
    assert scheduler.waiting_queue == [req]


def test_a_request_with_penalties_does_not_draft(setup) -> None:  # noqa: ANN001
    configure, calls = setup
    scheduler, side, req, progress = configure()
    req.sampling_params = FakeParams(top_k=1 << 30, temperature=1.0)
    req.sampling_params.frequency_penalty = 0.5  # type: ignore[attr-defined]
    _next(scheduler, FakeBatch([]))
    t = lynx(scheduler).tracked["r1"]
    assert "r1" in lynx(scheduler).parked and scheduler.waiting_queue == []
    assert "frequency_penalty" in str(t.state.fallback)
    progress.residual = True
    _next(scheduler, FakeBatch([]))
    assert t.state.phase is Phase.NORMAL and t.state.num_drafts == 0 and scheduler.waiting_queue == [req]
    assert not calls


def test_a_finish_on_the_exact_first_token_stands(setup) -> None:  # noqa: ANN001
    """The prefill's first token ends the request (EOS, or max_new_tokens = 1): nothing is drafted,
    the finish is not undone, the request ends in phase NORMAL (issue 16: a 9-token prompt whose
    first token was EOS kept decoding in ``lynx``, where ``lynx-int8`` stopped)."""
    configure, _ = setup
    scheduler, side, req, progress = configure()
    req.sampling_params.max_new_tokens = 1
    batch = FakeBatch([])
    _next(scheduler, batch)
    _admit(scheduler, batch)
    dst._around_update_finish_state(FakeReq.update_finish_state, req)
    assert req.finished() and not lynx(scheduler).tracked["r1"].finish_undone
    streamed: list[int] = []
    dst._around_accept(lambda acc, *, req: streamed.append(len(req.output_ids)), None, req=req)
    assert streamed == [1] and "r1" not in lynx(scheduler).tracked
    assert req.customized_info["lynx_phase"] == ["normal"] and req.customized_info["lynx_drafts"] == [0]
