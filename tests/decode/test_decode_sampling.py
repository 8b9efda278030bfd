"""Speculative sampling wiring (``integration/decode/sampling.py``, ``decode.commit``) with fakes:
which requests may draft, the record of draft laws taken at the sampler's input, and the verdict on
the target logits. The real thing runs in ``test_lynx_pd_speculative.py``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_lynx.decode.speculative import sampling_distribution
from sglang_lynx.integration.decode import sampling as dsm
from sglang_lynx.integration.decode.commit import SamplingVerify, sampled_chain_verdict
from stats_testlib import chi_square, critical_value

VOCAB = 6


@dataclass
class Params:
    temperature: float = 0.8
    top_k: int = 1 << 30
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: Any = None
    watermark: Any = None
    sampling_seed: int | None = None


@dataclass
class Req:
    rid: str
    sampling_params: Params
    grammar: Any = None
    custom_logit_processor: Any = None
    return_logprob: bool = False
    return_hidden_states: bool = False


@pytest.fixture
def laws() -> dsm.DraftLaws:
    """One decode server's draft-law records (a fresh server per test)."""
    return dsm.DraftLaws()


def test_plain_sampling_may_draft_and_every_logit_changer_blocks() -> None:
    assert dsm.speculation_blocker(Req("a", Params())) is None
    cases = {
        "frequency_penalty": Params(frequency_penalty=0.5), "presence_penalty": Params(presence_penalty=0.1),
        "repetition_penalty": Params(repetition_penalty=1.1), "min_new_tokens": Params(min_new_tokens=3),
        "logit_bias": Params(logit_bias={"3": 1.0}), "watermark": Params(watermark=object()),
    }
    for name, params in cases.items():
        reason = dsm.speculation_blocker(Req("a", params))
        assert reason is not None and name in reason, (name, reason)
    assert "grammar" in str(dsm.speculation_blocker(Req("a", Params(), grammar=object())))
    assert "return_logprob" in str(dsm.speculation_blocker(Req("a", Params(), return_logprob=True)))
    assert dsm.is_greedy(Req("a", Params(top_k=1))) and not dsm.is_greedy(Req("a", Params()))


class InPlaceSampler:
    """Like SGLang's sampler: overwrites the logits with probabilities, returns one token per row."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def forward(self, logits_output: Any, sampling_info: Any, *args: Any) -> torch.Tensor:
        logits_output.next_token_logits[:] = torch.softmax(logits_output.next_token_logits, dim=-1)
        return torch.tensor(self.tokens, dtype=torch.int32)


def _step(laws: dsm.DraftLaws, reqs: list[Req], logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """One decode step of a scheduler whose Lynx state holds ``laws`` (decode_state keeps it there)."""
    scheduler = SimpleNamespace(_lynx=SimpleNamespace(laws=laws))
    sampler = InPlaceSampler(tokens)
    output = type("LogitsOutput", (), {"next_token_logits": logits.clone()})()
    batch = type("Batch", (), {"reqs": reqs})()

    def run_batch(scheduler: Any, b: Any) -> torch.Tensor:
        return dsm._around_sampler_forward(type(sampler).forward, sampler, output, None)

    return dsm._around_run_batch(run_batch, scheduler, batch)  # type: ignore[no-any-return]


def test_the_record_holds_the_law_at_the_sampler_input_for_watched_rows_only(laws: dsm.DraftLaws) -> None:
    watched = Req("w", Params(temperature=0.7, top_k=3))
    other = Req("o", Params())
    laws.watch("w")
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    _step(laws, [other, watched], logits, [4, 2])
    _step(laws, [other, watched], logits.flip(-1), [1, 5])
    record = laws.records["w"]
    assert record.tokens == [2, 5] and "o" not in laws.records
    expected = sampling_distribution(logits[1:2], 0.7, top_k=3)[0].float()
    assert torch.allclose(record.probs[0], expected) and int((record.probs[0] > 0).sum()) == 3
    assert torch.equal(laws.draft_probs_for("w", [2, 5]), torch.stack(record.probs))
    assert laws.draft_probs_for("w", [2, 4]) is None  # not what the sampler returned: no exact record
    assert laws.draft_probs_for("w", [2]) is None
    laws.forget("w")
    assert laws.draft_probs_for("w", [2, 5]) is None and dsm._RUNNING.get() is None  # the call's batch is reset


def test_a_batch_whose_rows_do_not_match_its_requests_records_nothing(laws: dsm.DraftLaws) -> None:
    laws.watch("w")
    _step(laws, [Req("w", Params())], torch.zeros(2, VOCAB), [0, 1])  # 2 logit rows for 1 request
    assert laws.records["w"].tokens == []


P_LOGITS = torch.tensor([[2.0, 1.5, 0.5, 0.0, -1.0, -3.0]])
Q_LOGITS = torch.tensor([[-1.0, 0.0, 1.5, 2.0, 0.5, 0.0]])


def _first_verified(params: Params, with_record: bool, trials: int, seed: int) -> torch.Tensor:
    """Emitted token at the first draft position over many verifications (drafts drawn from q)."""
    gen = torch.Generator().manual_seed(seed)
    q = sampling_distribution(Q_LOGITS, params.temperature, top_k=params.top_k, top_p=params.top_p)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(trials):
        draft = torch.multinomial(q[0], 1, generator=gen)
        spec = SamplingVerify(params, q.float() if with_record else None, gen)
        verdict = sampled_chain_verdict(draft, P_LOGITS, spec)
        token = int(draft) if verdict.num_accepted == 1 else verdict.next_token
        assert token is not None
        counts[token] += 1
    return counts


@pytest.mark.parametrize("params", [Params(temperature=1.0), Params(temperature=0.7, top_k=4),
                                    Params(temperature=1.3, top_p=0.9)])
def test_verified_first_token_follows_the_target_law(params: Params) -> None:
    target = sampling_distribution(P_LOGITS, params.temperature, top_k=params.top_k, top_p=params.top_p)[0]
    for with_record in (True, False):
        counts = _first_verified(params, with_record, trials=4_000, seed=7)
        stat, dof = chi_square(counts, target)
        assert stat < critical_value(dof), (params, with_record, stat, counts.tolist())


def test_the_statistical_test_detects_drafts_released_unverified() -> None:
    """Accepting every draft would emit q, not p: the same test must reject it."""
    params = Params(temperature=1.0)
    q = sampling_distribution(Q_LOGITS, 1.0)[0]
    counts = torch.bincount(torch.multinomial(q, 4_000, replacement=True,
                                              generator=torch.Generator().manual_seed(7)), minlength=VOCAB)
    target = sampling_distribution(P_LOGITS, params.temperature)[0]
    stat, dof = chi_square(counts, target)
    assert stat > critical_value(dof)
