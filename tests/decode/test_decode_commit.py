"""verify_parked_request bookkeeping with a fake request, KV row and verify forward (extra unit tier;
the real forward is covered by test_verify_model.py and the PD tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from sglang_lynx.integration.decode import commit as decode_commit
from sglang_lynx.integration.decode.row_gemm import RowGemmPolicy

VOCAB = 16
EOS = 2


@dataclass
class FakeKV:
    req_pool_idx: int = 3
    kv_allocated_len: int = 0
    kv_committed_len: int = 0


@dataclass
class FakeParams:
    max_new_tokens: int = 100


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int]
    kv: FakeKV
    rid: str = "r"
    sampling_params: FakeParams = field(default_factory=FakeParams)
    finished_reason: Any = None
    finished_len: int | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self) -> None:
        if self.output_ids[-1] == EOS:
            self.finished_reason = "eos"
        elif len(self.output_ids) >= self.sampling_params.max_new_tokens:
            self.finished_reason = "length"


class FakeTreeCache:
    def __init__(self) -> None:
        self.freed: list[tuple[int, int]] = []

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        self.freed.extend(ranges)


class FakeProgress:
    def __init__(self) -> None:
        self.upgraded = 0

    def upgrade_kv(self) -> None:
        self.upgraded += 1


def _logits_for(targets: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(targets), VOCAB)
    for i, t in enumerate(targets):
        logits[i, t] = 1.0
    return logits


def _req(prompt_len: int, out: list[int]) -> FakeReq:
    n = len(out) - 1
    return FakeReq(list(range(100, 100 + prompt_len)), list(out), FakeKV(3, prompt_len + n, prompt_len + n))


def _patch(monkeypatch: pytest.MonkeyPatch, targets: list[int], calls: list[tuple[int, int, list[int]]]) -> None:
    def fake_verify(model_runner: Any, row: int, prefix_len: int, token_ids: list[int],
                    gemm: Any = None, last_rows: Any = None, attention: Any = None) -> torch.Tensor:
        calls.append((row, prefix_len, list(token_ids)))
        # the last len(targets) rows score the drafts; earlier rows (recompute) are arbitrary
        pad = [0] * (len(token_ids) - len(targets))
        return _logits_for(pad + targets)

    def fake_prefill(model_runner: Any, row: int, prompt: list[int], chunk: Any) -> int:
        calls.append((row, 0, list(prompt)))  # the recompute's prompt passes: from position 0, no logits
        return 1

    monkeypatch.setattr(decode_commit, "chain_verify_logits", fake_verify)
    monkeypatch.setattr(decode_commit, "prefill_prompt_kv", fake_prefill)


def test_partial_accept_keeps_prefix_and_correction_and_frees_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, list[int]]] = []
    _patch(monkeypatch, [5, 9, 7], calls)  # target says d1=5 (ok), d2=9 (draft 6: reject)
    req, cache, progress = _req(10, [4, 5, 6, 7]), FakeTreeCache(), FakeProgress()
    outcome = decode_commit.verify_parked_request(req, None, cache, progress, "verify")
    assert calls == [(3, 10, [4, 5, 6])]  # one pass over t0, d1, d2 at positions 10..12
    assert progress.upgraded == 1
    assert req.output_ids == [4, 5, 9]
    assert (outcome.num_drafts, outcome.num_accepted, outcome.new_output_len) == (3, 1, 3)
    assert cache.freed == [(12, 13)]  # KV valid for prompt + t0 + d1
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 12


@pytest.mark.parametrize(("prompt_len", "freed"), [
    (10, [(16, 20)]),  # kept KV ends at 14 (mid-page): its page stays, whole pages from 16 go
    (14, []),  # kept KV ends at 18, allocated 24: 18..24 is inside the request's last page: nothing freed
    (12, [(16, 22)]),  # kept KV ends exactly at a page boundary (16): everything from it goes
])
def test_paged_rollback_frees_whole_pages_only(monkeypatch: pytest.MonkeyPatch, prompt_len: int,
                                              freed: list[tuple[int, int]]) -> None:
    """``--page-size 8``: SGLang frees whole pages from a page-aligned start (``free_kv_row`` asserts
    it); KV bookkeeping still ends at the kept length, mid-page (the next decode step's slot follows)."""
    _patch(monkeypatch, [5, 6, 7, 9, 1, 1, 1, 1, 1, 1], [])  # d1..d3 accepted, d4 rejected
    cache = FakeTreeCache()
    cache.page_size = 8  # type: ignore[attr-defined]
    req = _req(prompt_len, [4, 5, 6, 7, 8, 8, 8, 8, 8, 8, 8])
    decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify")
    assert req.output_ids == [4, 5, 6, 7, 9]
    assert cache.freed == freed
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == prompt_len + 4


def test_full_accept_frees_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(monkeypatch, [5, 6, 7], [])
    req, cache = _req(10, [4, 5, 6, 7]), FakeTreeCache()
    outcome = decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify")
    assert req.output_ids == [4, 5, 6, 7] and outcome.num_accepted == 3
    assert cache.freed == [] and req.kv.kv_allocated_len == 13


def test_finish_is_replayed_token_by_token(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(monkeypatch, [5, EOS, 7, 8], [])  # EOS accepted as the second draft; later drafts dropped
    req = _req(10, [4, 5, EOS, 7, 8])
    outcome = decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "verify")
    assert outcome.finished and req.finished_reason == "eos"
    assert req.output_ids == [4, 5, EOS]


def test_max_tokens_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(monkeypatch, [5, 6, 7], [])
    req = _req(10, [4, 5, 6, 7])
    req.sampling_params.max_new_tokens = 2
    outcome = decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "verify")
    assert outcome.finished and req.output_ids == [4, 5]


def test_recompute_prefills_the_prompt_then_verifies_the_drafts_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt's KV rebuilt as a prefill computes it (no upgrade), then the same chain verify as after an
    upgrade: the drafts' rows are decode-batch rows (decode-exact), not rows of one long EXTEND."""
    calls: list[tuple[int, int, list[int]]] = []
    _patch(monkeypatch, [5, 6], calls)
    req, progress = _req(4, [4, 5, 6]), FakeProgress()
    outcome = decode_commit.verify_parked_request(req, None, FakeTreeCache(), progress, "recompute")
    assert calls == [(3, 0, [100, 101, 102, 103]), (3, 4, [4, 5])]
    assert progress.upgraded == 0 and req.output_ids == [4, 5, 6]
    assert outcome.rows == 4 + 2  # the prompt's rows computed again, then the verify's


def test_no_drafts_recompute_rebuilds_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, list[int]]] = []
    _patch(monkeypatch, [], calls)
    req = _req(3, [4])
    decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "recompute")
    assert calls == [(3, 0, [100, 101, 102])] and req.output_ids == [4]


def test_the_recompute_prefill_gets_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks: list[Any] = []
    _patch(monkeypatch, [5], [])
    monkeypatch.setattr(decode_commit, "prefill_prompt_kv", lambda mr, row, prompt, chunk: chunks.append(chunk) or 1)
    decode_commit.verify_parked_request(_req(3, [4, 5]), None, FakeTreeCache(), FakeProgress(), "recompute",
                                        prefill_chunk=2)
    assert chunks == [2]


def test_inconsistent_kv_bookkeeping_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(monkeypatch, [5], [])
    req = _req(10, [4, 5])
    req.kv.kv_allocated_len += 1
    with pytest.raises(RuntimeError, match="KV bookkeeping"):
        decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "verify")


def test_output_ids_stay_an_array_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang keeps output_ids as array('q'); a list there breaks incremental detokenization."""
    from array import array

    _patch(monkeypatch, [5, 9, 7], [])
    req = _req(10, [4, 5, 6, 7])
    original = array("q", req.output_ids)
    req.output_ids = original  # type: ignore[assignment]
    decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "verify")
    assert req.output_ids is original and list(original) == [4, 5, 9]


@pytest.mark.parametrize(("gemm", "dtype", "margin"), [
    (None, torch.bfloat16, 0.0),  # decode-batch verify with 1-row GEMMs (default): exact, no guard
    (RowGemmPolicy("rows"), torch.bfloat16, 0.0),  # the row kernel: each row as its 1-row GEMM, exact
    (RowGemmPolicy("split"), torch.bfloat16, 0.0),
    (RowGemmPolicy("batched"), torch.bfloat16, 0.25),  # n-row GEMMs in 16 bits: the guard
    (RowGemmPolicy("batched"), torch.float32, 0.0),
])
def test_automatic_tie_margin_follows_the_verify_gemms(monkeypatch: pytest.MonkeyPatch, gemm: Any,
                                                       dtype: torch.dtype, margin: float) -> None:
    _patch(monkeypatch, [5, 9, 7], [])
    used: list[float] = []
    real = decode_commit.greedy_chain_accept

    def spy(drafts: torch.Tensor, logits: torch.Tensor, tie_margin: float = 0.0) -> Any:
        used.append(tie_margin)
        return real(drafts, logits, tie_margin)

    monkeypatch.setattr(decode_commit, "greedy_chain_accept", spy)
    runner = type("Runner", (), {"dtype": dtype})()
    decode_commit.verify_parked_request(_req(10, [4, 5, 6, 7]), runner, FakeTreeCache(), FakeProgress(), "verify",
                                        tie_margin=-1.0, gemm=gemm)
    assert used == [margin]


def _patch_by_position(monkeypatch: pytest.MonkeyPatch, prompt_len: int, targets: list[int],
                       calls: list[tuple[int, int, list[int]]], attentions: list[Any] | None = None) -> None:
    """A fake verify forward whose row at position p scores ``targets[p - prompt_len]`` (pass-independent);
    ``attentions`` records the attention kernel each pass was given."""
    def fake_verify(model_runner: Any, row: int, prefix_len: int, token_ids: list[int],
                    gemm: Any = None, last_rows: Any = None, attention: Any = None) -> torch.Tensor:
        calls.append((row, prefix_len, list(token_ids)))
        if attentions is not None:
            attentions.append(attention)
        start = prefix_len - prompt_len
        return _logits_for(targets[start: start + len(token_ids)])

    monkeypatch.setattr(decode_commit, "chain_verify_logits", fake_verify)


@pytest.mark.parametrize(("targets", "passes", "kept"), [
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 1], [(10, 4), (14, 6)], [5, 6, 7, 8, 9, 10, 11, 12, 13, 1]),  # all accepted
    ([5, 9, 1, 1, 1, 1, 1, 1, 1, 1], [(10, 4)], [5, 9]),  # d2 rejected: the first pass decides, 6 rows saved
    ([5, 6, 7, 8, 9, 10, 3, 1, 1, 1], [(10, 4), (14, 6)], [5, 6, 7, 8, 9, 10, 3]),  # d7 rejected in pass 2
])
def test_a_verify_in_passes_reaches_the_one_pass_verdict(monkeypatch: pytest.MonkeyPatch, targets: list[int],
                                                          passes: list[tuple[int, int]], kept: list[int]) -> None:
    """``first_pass=4``: passes of 4 then 8 inputs at positions prompt_len + start; the same output, KV
    bookkeeping and frees as one pass, and no pass after the one that rejected."""
    drafts = [5, 6, 7, 8, 9, 10, 11, 12, 13, 1]
    outcomes = []
    attention = object()  # the server's chain attention kernel: handed to every pass, one pass or several
    for first_pass in (0, 4):
        calls: list[tuple[int, int, list[int]]] = []
        attentions: list[Any] = []
        _patch_by_position(monkeypatch, 10, targets, calls, attentions)
        req, cache = _req(10, [4, *drafts]), FakeTreeCache()
        outcome = decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify", first_pass=first_pass,
                                                      attention=attention)
        assert attentions == [attention] * len(calls)
        outcomes.append((list(req.output_ids), outcome.num_accepted, cache.freed, req.kv.kv_allocated_len))
        inputs = [4, *drafts[:-1]]
        want = [(10, 10)] if first_pass == 0 else passes
        assert [(p, len(ids)) for _, p, ids in calls] == want
        assert all(ids == inputs[p - 10: p - 10 + len(ids)] for _, p, ids in calls)
        assert outcome.rows == sum(len(ids) for _, _, ids in calls)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [4, *kept]


def test_the_recompute_fallback_verifies_in_passes_after_its_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the prompt's prefill the recompute's verify is the decode-batch verify, in passes as after an
    upgrade (the pass of 4 rejects d2 and stops it)."""
    calls: list[tuple[int, int, list[int]]] = []
    _patch(monkeypatch, [5, 9, 7], calls)
    req = _req(10, [4, 5, 6, 7])
    decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "recompute", first_pass=4)
    assert [(p, len(ids)) for _, p, ids in calls] == [(0, 10), (10, 3)]
    assert req.output_ids == [4, 5, 9]


def _fake_bonus_slot(monkeypatch: pytest.MonkeyPatch, available: bool = True) -> list[int]:
    """``decode.bonus_slot.reserve_bonus_slot`` as a fake row grows (the real one: test_bonus_slot.py)."""
    reserved: list[int] = []

    def reserve(req: FakeReq, model_runner: Any, tree_cache: Any) -> bool:
        if not available:
            return False
        reserved.append(req.kv.kv_allocated_len)
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1
        return True

    monkeypatch.setattr(decode_commit, "reserve_bonus_slot", reserve)
    return reserved


@pytest.mark.parametrize("first_pass", [0, 4])
def test_a_fully_accepted_window_releases_the_bonus_token(monkeypatch: pytest.MonkeyPatch, first_pass: int) -> None:
    """One more row (input: the last draft, in the slot reserved at position L + n) scores the token after the
    last draft; every draft accepted, it is released too, and its KV slot stays with the request."""
    calls: list[tuple[int, int, list[int]]] = []
    _patch_by_position(monkeypatch, 10, [5, 6, 7, 8, 9, 10, 11], calls)
    reserved = _fake_bonus_slot(monkeypatch)
    req, cache = _req(10, [4, 5, 6, 7, 8, 9, 10]), FakeTreeCache()  # t0 and 6 drafts
    outcome = decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify", first_pass=first_pass,
                                                  bonus=True)
    assert reserved == [16]  # the last draft's input position
    assert [p for _, p, _ in calls] == ([10] if first_pass == 0 else [10, 14])
    assert [i for _, _, ids in calls for i in ids] == [4, 5, 6, 7, 8, 9, 10]  # the bonus row's input: d6
    assert req.output_ids == [4, 5, 6, 7, 8, 9, 10, 11] and outcome.bonus and outcome.num_accepted == 6
    assert cache.freed == [] and req.kv.kv_allocated_len == req.kv.kv_committed_len == 17
    assert outcome.rows == 7


@pytest.mark.parametrize("first_pass", [0, 4])
def test_a_rejected_draft_frees_the_bonus_slot_with_the_others(monkeypatch: pytest.MonkeyPatch,
                                                               first_pass: int) -> None:
    _patch_by_position(monkeypatch, 10, [5, 9, 1, 1, 1, 1, 1], [])
    _fake_bonus_slot(monkeypatch)
    req, cache = _req(10, [4, 5, 6, 7, 8, 9, 10]), FakeTreeCache()
    outcome = decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify", first_pass=first_pass,
                                                  bonus=True)
    assert req.output_ids == [4, 5, 9] and not outcome.bonus
    assert cache.freed == [(12, 17)] and req.kv.kv_allocated_len == req.kv.kv_committed_len == 12


def test_a_near_tie_at_the_bonus_row_releases_no_bonus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy with a tie margin: the bonus row's top-2 margin is a near-tie, so the decode step decides that
    position (its slot is freed; the next step writes it again)."""
    def fake_verify(model_runner: Any, row: int, prefix_len: int, token_ids: list[int], *rest: Any,
                    **kw: Any) -> torch.Tensor:
        logits = _logits_for([5, 6, 7])
        logits[2, 3] = 0.95  # the bonus row: 7 leads 3 by 0.05
        return logits

    monkeypatch.setattr(decode_commit, "chain_verify_logits", fake_verify)
    _fake_bonus_slot(monkeypatch)
    req, cache = _req(10, [4, 5, 6]), FakeTreeCache()
    outcome = decode_commit.verify_parked_request(req, None, cache, FakeProgress(), "verify", tie_margin=0.1,
                                                  bonus=True)
    assert req.output_ids == [4, 5, 6] and outcome.num_accepted == 2 and not outcome.bonus
    assert cache.freed == [(12, 13)] and req.kv.kv_allocated_len == 12


@pytest.mark.parametrize(("max_new", "available", "rows"), [
    (3, True, 2),  # max_new_tokens ends at the last draft: no token after it is ever released
    (100, False, 2),  # no free slot: the verify runs its n rows as before
    (100, True, 3),
])
def test_no_bonus_row_without_room_or_slot(monkeypatch: pytest.MonkeyPatch, max_new: int, available: bool,
                                           rows: int) -> None:
    calls: list[tuple[int, int, list[int]]] = []
    _patch_by_position(monkeypatch, 10, [5, 6, 7], calls)
    reserved = _fake_bonus_slot(monkeypatch, available)
    req = _req(10, [4, 5, 6])
    req.sampling_params.max_new_tokens = max_new
    outcome = decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "verify", bonus=True)
    assert outcome.rows == rows and len(reserved) == (rows == 3)
    assert req.output_ids == ([4, 5, 6, 7] if rows == 3 else [4, 5, 6])


def test_the_recompute_fallback_takes_the_bonus_row_too(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, list[int]]] = []
    _patch(monkeypatch, [5, 6, 8], calls)
    _fake_bonus_slot(monkeypatch)
    req = _req(4, [4, 5, 6])
    outcome = decode_commit.verify_parked_request(req, None, FakeTreeCache(), FakeProgress(), "recompute", bonus=True)
    assert calls == [(3, 0, [100, 101, 102, 103]), (3, 4, [4, 5, 6])]
    assert req.output_ids == [4, 5, 6, 8] and outcome.bonus and req.kv.kv_allocated_len == 7
