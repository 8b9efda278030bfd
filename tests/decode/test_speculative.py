"""Accept/reject math of sglang_lynx.decode.speculative (pure torch, fast).

Statistical tests use a fixed seed and a chi-square goodness-of-fit test at a stated false-alarm
rate: with a correct implementation each would fail with probability FALSE_ALARM for a random seed;
the seed is fixed, so the result is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from sglang_lynx.decode import speculative
from sglang_lynx.decode.speculative import (
    ChainVerdict,
    greedy_chain_accept,
    residual_distribution,
    sampling_distribution,
    speculative_sample_chain,
)
from stats_testlib import chi_square, critical_value

P0 = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0], dtype=torch.float64)
Q0 = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
P1 = torch.tensor([0.05, 0.05, 0.4, 0.1, 0.2, 0.2], dtype=torch.float64)
Q1 = torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)


def sample_first_tokens(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)
    for d in drafts.tolist():
        verdict = speculative_sample_chain(torch.tensor([d]), q[None], p[None], generator=gen)
        token = d if verdict.num_accepted == 1 else verdict.next_token
        assert token is not None
        counts[token] += 1
    return counts


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_longest_prefix_and_corrects_first_mismatch() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 64):
        logits = torch.randn(n, 50, generator=gen)
        target = logits.argmax(-1)
        for k in range(n + 1):
            drafts = target.clone()
            if k < n:
                drafts[k] = (target[k] + 1) % 50
                if k + 1 < n:  # later drafts agreeing again must not be accepted
                    drafts[k + 1 :] = target[k + 1 :]
            verdict = greedy_chain_accept(drafts, logits)
            assert verdict.num_accepted == k
            assert verdict.next_token == (int(target[k]) if k < n else None)


def test_greedy_bonus_token_after_full_accept() -> None:
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    drafts = logits[:3].argmax(-1)
    verdict = greedy_chain_accept(drafts, logits)
    assert verdict == ChainVerdict(3, 3, int(logits[3].argmax()))
    assert verdict.emitted(drafts.tolist()) == logits.argmax(-1).tolist()


def test_greedy_chain_equals_sequential_greedy_decoding() -> None:
    """A toy 'model' whose next-token logits depend on the previous token (a transition table):
    drafting with a perturbed table and verifying with the true one must reproduce plain greedy."""
    gen = torch.Generator().manual_seed(2)
    vocab = 30
    for trial in range(40):
        true_table = torch.randn(vocab, vocab, generator=gen)
        draft_table = true_table + 0.8 * torch.randn(vocab, vocab, generator=gen)
        t0 = trial % vocab
        drafts, prev = [], t0
        for _ in range(16):
            prev = int(draft_table[prev].argmax())
            drafts.append(prev)
        inputs = [t0, *drafts]
        verdict = greedy_chain_accept(torch.tensor(drafts), true_table[inputs])  # n + 1 rows: bonus
        emitted = verdict.emitted(drafts)
        reference, prev = [], t0
        for _ in range(len(emitted)):
            prev = int(true_table[prev].argmax())
            reference.append(prev)
        assert emitted == reference


@pytest.mark.parametrize(
    ("drafts", "logits", "message"),
    [
        (torch.tensor([[1]]), torch.zeros(1, 4), "1-D"),
        (torch.tensor([1, 2]), torch.zeros(4, 4), "expected 2 or 3"),
        (torch.tensor([7]), torch.zeros(1, 4), "outside the vocabulary"),
        (torch.tensor([1]), torch.tensor([[0.0, float("nan"), 0.0, 0.0]]), "NaN"),
    ],
)
def test_greedy_rejects_bad_input(drafts: torch.Tensor, logits: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        greedy_chain_accept(drafts, logits)


# ---------------------------------------------------------------- residual and sampling


def test_residual_distribution_values() -> None:
    # max(0, P0 - Q0) = [0.4, 0.2, 0, 0, 0, 0] -> normalised [2/3, 1/3, 0, 0, 0, 0]
    expected = torch.tensor([2 / 3, 1 / 3, 0, 0, 0, 0], dtype=torch.float64)
    assert torch.allclose(residual_distribution(P0, Q0), expected)
    assert torch.equal(residual_distribution(P0, P0), P0)  # vanishing residual falls back to p


def test_speculative_sampling_first_token_follows_target() -> None:
    counts = sample_first_tokens(P0, Q0, trials=6_000, seed=1234)
    stat, dof = chi_square(counts, P0)
    assert stat < critical_value(dof), (stat, counts.tolist())


def test_statistical_test_detects_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test must fail when rejection resamples from p instead of norm(max(0, p - q)):
    the output would then be min(p, q) + beta * p = [0.40, 0.28, 0.16, 0.16] instead of P0."""
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    counts = sample_first_tokens(P0, Q0, trials=6_000, seed=1234)
    stat, dof = chi_square(counts, P0)
    assert stat > critical_value(dof), (stat, counts.tolist())


def test_speculative_sampling_second_token_follows_target_given_first_accepted() -> None:
    gen = torch.Generator().manual_seed(99)
    q = torch.stack([Q0, Q1])
    p = torch.stack([P0, P1, P0])  # third row: bonus
    second = torch.zeros_like(P1)
    for _ in range(6_000):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(2)])
        verdict = speculative_sample_chain(drafts, q, p, generator=gen)
        emitted = verdict.emitted(drafts.tolist())
        if verdict.num_accepted >= 1:
            second[emitted[1]] += 1
    stat, dof = chi_square(second, P1)
    assert second.sum() > 500
    assert stat < critical_value(dof), (stat, second.tolist())


def test_identical_draft_and_target_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(8, 20, generator=gen, dtype=torch.float64), -1)
    for _ in range(50):
        drafts = torch.stack([torch.multinomial(p[i], 1, generator=gen)[0] for i in range(8)])
        assert speculative_sample_chain(drafts, p, p, generator=gen).num_accepted == 8


def test_speculative_sampling_rejects_non_distributions() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        speculative_sample_chain(torch.tensor([0]), torch.tensor([[0.5, 0.2]]), torch.tensor([[0.5, 0.5]]))


def test_sampling_distribution_masks() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    full = torch.softmax(logits.double(), -1)
    assert torch.allclose(sampling_distribution(logits, 1.0), full)
    top1 = sampling_distribution(logits, 0.7, top_k=1)
    assert torch.equal(top1, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    # top_p = 0.8: cumulative mass before each sorted entry is [0, .644, .881, ...] -> keep 2
    top_p = sampling_distribution(logits, 1.0, top_p=0.8)
    assert torch.allclose(top_p[0, :2], full[0, :2] / full[0, :2].sum()) and top_p[0, 2:].sum() == 0
    with pytest.raises(ValueError, match="temperature"):
        sampling_distribution(logits, 0.0)


# ---------------------------------------------------------------- near-tie guard


def test_tie_margin_stops_acceptance_before_a_near_tie_and_emits_nothing_there() -> None:
    logits = torch.zeros(4, 5)
    logits[0, 1] = 3.0  # clear: draft 1 accepted
    logits[1, 2], logits[1, 3] = 2.0, 1.5  # margin 0.5, argmax 2 == draft
    logits[2, 4] = 3.0
    logits[3, 0] = 3.0
    drafts = torch.tensor([1, 2, 4])
    assert greedy_chain_accept(drafts, logits) == ChainVerdict(3, 3, 0)  # exact rule: all + bonus
    assert greedy_chain_accept(drafts, logits, tie_margin=0.5) == ChainVerdict(3, 1, None)
    assert greedy_chain_accept(drafts, logits, tie_margin=0.4) == ChainVerdict(3, 3, 0)
    mismatch = torch.tensor([1, 3, 4])  # the draft loses a near-tie: no correction either
    assert greedy_chain_accept(mismatch, logits, tie_margin=0.5) == ChainVerdict(3, 1, None)
    assert greedy_chain_accept(mismatch, logits) == ChainVerdict(3, 1, 2)
    logits[3, 1] = 2.9  # the bonus position is a near-tie: no bonus
    assert greedy_chain_accept(drafts, logits, tie_margin=0.4) == ChainVerdict(3, 3, None)
    with pytest.raises(ValueError, match="tie_margin"):
        greedy_chain_accept(drafts, logits, tie_margin=-1.0)


def test_auto_tie_margin_by_dtype() -> None:
    assert speculative.auto_tie_margin(-1.0, torch.float32) == 0.0
    assert speculative.auto_tie_margin(-1.0, torch.bfloat16) == speculative.AUTO_TIE_MARGIN_16BIT > 0
    assert speculative.auto_tie_margin(0.25, torch.bfloat16) == 0.25
    # the decode-like verify attention computes the decode step's logits: no guard needed
    assert speculative.auto_tie_margin(-1.0, torch.bfloat16, verify_is_decode_exact=True) == 0.0
    assert speculative.auto_tie_margin(0.5, torch.bfloat16, verify_is_decode_exact=True) == 0.5
