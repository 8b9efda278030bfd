"""The verify's row GEMM policy (unit tier, fake GEMMs): ``split`` runs one 1-row GEMM per row and
returns the rows in order; ``batched`` one GEMM; outside a verify the linear hook passes through."""

from __future__ import annotations

import pytest
import torch

from sglang_lynx.integration.decode.row_gemm import (
    RowGemmPolicy,
    _around_linear_apply,
    row_invariant_gemms,
    rows_like_decode,
)
from sglang_lynx.integration.decode.verify import decode_batch_applies


class CountingGemm:
    def __init__(self) -> None:
        self.row_counts: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.row_counts.append(int(x.shape[0]))
        return x * 2 + 1


def test_split_runs_one_row_at_a_time_in_order() -> None:
    gemm, x = CountingGemm(), torch.arange(12.0).view(4, 3)
    policy = RowGemmPolicy("split")
    with row_invariant_gemms(policy):
        out = rows_like_decode(gemm, x)
    assert torch.equal(out, x * 2 + 1)
    assert gemm.row_counts == [1, 1, 1, 1]
    assert policy.calls == {"batched": 0, "split": 1}


def test_batched_and_no_policy_run_one_gemm() -> None:
    gemm, x = CountingGemm(), torch.ones(5, 2)
    with row_invariant_gemms(RowGemmPolicy("batched")):
        rows_like_decode(gemm, x)
    rows_like_decode(gemm, x)  # no verify active
    assert gemm.row_counts == [5, 5]
    with pytest.raises(ValueError, match="policy"):
        RowGemmPolicy("probe")


def test_linear_hook_passes_through_outside_a_verify_and_splits_inside() -> None:
    calls: list[int] = []

    def original(method: object, layer: object, x: torch.Tensor, bias: object = None) -> torch.Tensor:
        calls.append(int(x.shape[0]))
        return x

    x = torch.zeros(3, 4)
    _around_linear_apply(original, None, None, x)
    with row_invariant_gemms(RowGemmPolicy("split")):
        _around_linear_apply(original, None, None, x)
        _around_linear_apply(original, None, None, x[:1])
    assert calls == [3, 1, 1, 1, 1]


def test_decode_batch_verify_applies_to_chains_after_a_prefix() -> None:
    assert decode_batch_applies(10, 1) and decode_batch_applies(10, 64)
    assert not decode_batch_applies(0, 5)  # recompute fallback: an extend from position 0
    assert not decode_batch_applies(10, 0)
