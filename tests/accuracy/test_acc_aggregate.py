"""Aggregation: seed means, spread, error counting, agreement validation."""

from __future__ import annotations

from typing import Any

import pytest
from benchmark.accuracy.aggregate import accuracy_rows, accuracy_table, agreement_rows


def record(seed: int, score: float, status: str = "ok", depth: float = 0.0, **extra: Any) -> dict[str, Any]:
    base = {"mode": "m", "task": "t", "context_tokens_target": 1024, "seed": seed, "score": score,
            "status": status, "instance_id": f"t/{seed}/{depth}", "token_kind": "ids", "output_tokens": []}
    return {**base, **extra}


def test_seed_means_then_spread() -> None:
    records = [record(0, 1.0, depth=0), record(0, 0.0, depth=1)]
    records += [record(1, 1.0, depth=0), record(1, 1.0, depth=1)]
    (row,) = accuracy_rows(records)
    assert row.mean == pytest.approx(0.75)
    assert row.std == pytest.approx(0.25)
    assert (row.minimum, row.maximum, row.seeds, row.instances, row.errors) == (0.5, 1.0, 2, 4, 0)
    assert "| m | t | 1024 | 0.750 | 0.250 | 0.500 | 1.000 | 2 | 4 | 0 |" in accuracy_table([row])


def test_failed_requests_count_as_errors() -> None:
    (row,) = accuracy_rows([record(0, 0.0, status="timeout"), record(1, 1.0)])
    assert row.errors == 1 and row.mean == pytest.approx(0.5)


def test_agreement_needs_same_token_kind() -> None:
    ref = [record(0, 1.0, output_tokens=[1, 2, 3])]
    same = [record(0, 1.0, mode="x", output_tokens=[1, 2, 4])]
    (row,) = agreement_rows(ref, same)
    assert (row.matched, row.mean_common_prefix) == (1, 2.0)
    assert row.mean_match_rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="token kinds"):
        agreement_rows(ref, [record(0, 1.0, token_kind="strings", output_tokens=["a"])])
