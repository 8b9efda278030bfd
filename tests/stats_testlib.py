"""Goodness-of-fit helpers for the statistical tests of speculative sampling.

Every statistical test states its false-alarm rate: with a correct implementation the test fails
with probability ``FALSE_ALARM`` over the randomness it uses (a fixed seed makes pure-math tests
deterministic; tests against a real server inherit the server's sampling randomness).
"""

from __future__ import annotations

import torch
from scipy.stats import chi2

FALSE_ALARM = 1e-3


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the categories with positive expected probability; (stat, dof).

    A count in a category of zero expected probability makes the statistic infinite."""
    counts = counts.double()
    expected_probs = expected_probs.double()
    total = float(counts.sum())
    support = expected_probs > 0
    if (counts[~support] > 0).any():
        return float("inf"), int(support.sum()) - 1
    expected = expected_probs[support] / expected_probs[support].sum() * total
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def critical_value(dof: int, false_alarm: float = FALSE_ALARM) -> float:
    """The chi-square statistic a correct sampler exceeds with probability ``false_alarm``."""
    return float(chi2.ppf(1.0 - false_alarm, dof))
