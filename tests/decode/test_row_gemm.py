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
    assert policy.calls == {"batched": 0, "split": 1, "rows": 0}


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


class UnquantizedLinearMethod:
    """Stands in for SGLang's (matched by class name in ``RowKernel.prepare``): ``F.linear`` as on the CPU."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: object = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight)


class FakeLinear(torch.nn.Module):
    def __init__(self, n: int, k: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) / k**0.5).bfloat16(), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()
        self.bias = None


def _row_kernel_or_skip() -> None:
    from sglang_lynx.kernels import lynx_rows_gemm

    lynx_rows_gemm.build()
    if not lynx_rows_gemm.available():
        pytest.skip("no AVX512-BF16 here: the rows policy splits (tested below without the kernel)")


def test_rows_runs_the_kernel_and_equals_split_bit_for_bit() -> None:
    _row_kernel_or_skip()
    layer = FakeLinear(576, 1536, 0)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    policy, split = RowGemmPolicy("rows"), RowGemmPolicy("split")
    original = UnquantizedLinearMethod.apply
    with row_invariant_gemms(split):
        want = _around_linear_apply(original, layer.quant_method, layer, x)
    with row_invariant_gemms(policy):
        first = _around_linear_apply(original, layer.quant_method, layer, x)  # first use: checked against split
        again = _around_linear_apply(original, layer.quant_method, layer, x)  # the kernel alone
    assert torch.equal(first.view(torch.int16), want.view(torch.int16))
    assert torch.equal(again.view(torch.int16), want.view(torch.int16))
    assert policy.calls == {"batched": 0, "split": 0, "rows": 2} and policy.decode_exact
    assert policy.kernel is not None and policy.kernel.packed_bytes == 576 * 1536 * 2


def test_rows_keeps_split_for_a_gemm_it_does_not_reproduce() -> None:
    """A weight whose SGLang GEMM is not the plain 1-row bf16 GEMM (here: one that adds 1) is refused on
    first use and stays on 1-row GEMMs; rows without a weight (a bias, a closure) split too."""
    _row_kernel_or_skip()
    layer = FakeLinear(64, 576, 2)
    x = torch.randn(3, 576).bfloat16()
    calls: list[int] = []

    def plus_one(method: object, lay: FakeLinear, rows: torch.Tensor, bias: object = None) -> torch.Tensor:
        calls.append(int(rows.shape[0]))
        return torch.nn.functional.linear(rows, lay.weight) + 1

    policy = RowGemmPolicy("rows")
    with row_invariant_gemms(policy):
        for _ in range(2):
            out = _around_linear_apply(plus_one, layer.quant_method, layer, x)
            assert torch.equal(out, torch.cat([torch.nn.functional.linear(x[i:i + 1], layer.weight) + 1
                                               for i in range(3)]))
        rows_like_decode(CountingGemm(), torch.ones(4, 2))  # no weight given
    assert calls == [1] * 9  # every row of both calls as a 1-row GEMM (the first use's check: 3 more)
    assert policy.calls == {"batched": 0, "split": 3, "rows": 0}
    assert policy.kernel is not None and policy.kernel.packed_bytes == 0


def test_prepare_admits_every_linear_layer_and_the_lm_head() -> None:
    _row_kernel_or_skip()

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(1000, 576).bfloat16(), requires_grad=False)

    class Processor:
        def _compute_lm_head(self, hidden: torch.Tensor, head: Head, bias: object) -> torch.Tensor:
            return torch.matmul(hidden, head.weight.T)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([FakeLinear(960, 576, 3), FakeLinear(576, 1536, 4)])
            self.biased = FakeLinear(64, 576, 5)
            self.biased.bias = torch.nn.Parameter(torch.zeros(64))  # not the verify's (bias): left out
            self.lm_head = Head()
            self.logits_processor = Processor()

    policy = RowGemmPolicy("rows")
    assert policy.kernel is not None
    assert policy.kernel.prepare(Model()) == (3, 0)
    assert policy.kernel.packed_bytes == (960 * 576 + 576 * 1536 + 1008 * 576) * 2  # N padded to 16
    fp32 = Model().float()  # fp32 weights never fit the kernel: counted as kept on 1-row GEMMs
    fp32_policy = RowGemmPolicy("rows")
    assert fp32_policy.kernel is not None and fp32_policy.kernel.prepare(fp32) == (0, 3)


def test_rows_without_the_kernel_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_lynx.integration.decode import row_kernel

    monkeypatch.setattr(row_kernel.lynx_rows_gemm, "available", lambda: False)
    layer, x = FakeLinear(32, 64, 6), torch.randn(3, 64).bfloat16()
    policy = RowGemmPolicy("rows")
    with row_invariant_gemms(policy):
        out = _around_linear_apply(UnquantizedLinearMethod.apply, layer.quant_method, layer, x)
    assert torch.equal(out, torch.cat([torch.nn.functional.linear(x[i:i + 1], layer.weight) for i in range(3)]))
    assert policy.calls == {"batched": 0, "split": 1, "rows": 0}
    assert policy.kernel is not None and policy.kernel.prepare(torch.nn.Module()) == (0, 0)
