"""Row-invariant GEMMs for the chain verify: every verified row rounds exactly as a decode step's row.

Why: a decode step of one request multiplies a 1-row activation by each weight; the chain verify
multiplies ``n`` rows at once. A CPU bf16 GEMM does not promise that row ``i`` of an ``n``-row product
equals the 1-row product of row ``i`` (measured on this host, torch 2.14.1, oneDNN, 1 thread:
``[m, 1536] x [1536, 576]`` on random data differs for m = 4, 16, 32, 64 and agrees for m = 2, 8,
9; with the model's real weights and activations it differs at m = 16 too). A verify whose rows round
differently writes different KV for the accepted drafts, and greedy decoding later leaves the
``lynx-int8`` path (issue 16: 23 of 60 bf16 prompts on a paced link).

What: while :func:`row_invariant_gemms` is active (only inside a verify forward), every
``UnquantizedLinearMethod.apply`` over more than one row, and the LM head through
:func:`rows_like_decode`, computes each row exactly as its own 1-row GEMM would, by one of:

- ``rows`` (the default): all rows in one pass over the weight by ``kernels/lynx_rows_gemm``, which
  performs the 1-row GEMM's own additions in its order (``integration/decode/row_kernel.py``: checked per
  weight shape on adversarial inputs and per weight on its first real rows against SGLang's 1-row GEMMs;
  where either check fails or the kernel is not available, the 1-row GEMMs of ``split``);
- ``split``: each row as its own 1-row GEMM (the decode step's computation by construction; reads every
  weight once per row);
- ``batched``: SGLang's one batched GEMM (fewer weight reads, not exact where the GEMM is not
  row-invariant).

A probe that would batch only the shapes where random inputs showed the batched kernel rounding
like the 1-row kernel was tried and dropped: on this host it passed ``[16, 1536] x [1536, 576]`` on
random inputs while the same GEMM differed on the verify's real activations. Row equality of a
GEMM is not a property of its shape that a probe can establish; the ``rows`` kernel is not a probe of
SGLang's batched GEMM but a reimplementation of the 1-row GEMM, checked on inputs built to expose any
other order of additions.

Invariants: outside the context the hook is a pass-through (one ContextVar read); with ``split``
the result is the 1-row computation by construction, with ``rows`` equal to it bit for bit (as checked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from sglang_lynx.integration.decode.row_kernel import RowKernel, linear_one_row, lm_head_one_row, split_rows

POLICIES = ("rows", "split", "batched")
DECODE_EXACT_POLICIES = ("rows", "split")


class RowGemmPolicy:
    """How a verify forward multiplies its rows: the row kernel (``rows``), one 1-row GEMM each
    (``split``), or batched. ``calls`` counts the multi-row GEMMs each way took."""

    def __init__(self, policy: str = "rows") -> None:
        if policy not in POLICIES:
            raise ValueError(f"row GEMM policy {policy!r}: valid {', '.join(POLICIES)}")
        self.policy = policy
        self.calls = {"batched": 0, "split": 0, "rows": 0}
        self.kernel = RowKernel() if policy == "rows" else None

    @property
    def decode_exact(self) -> bool:
        """Whether every row rounds as a 1-row GEMM (``rows`` and ``split``)."""
        return self.policy in DECODE_EXACT_POLICIES

    def apply(self, gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: Any = None,
              one_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear_one_row) -> torch.Tensor:
        """``gemm(x)``; under ``rows`` and ``split`` every row rounded as a 1-row GEMM rounds it. ``weight``
        (the [N, K] matrix ``gemm`` multiplies by, with ``one_row`` the host computation of one row) lets
        ``rows`` run its kernel; without it ``rows`` splits."""
        if x.dim() != 2 or x.shape[0] <= 1 or self.policy == "batched":
            self.calls["batched"] += 1
            return gemm(x)
        if self.kernel is not None and weight is not None:
            out = self.kernel.rows(gemm, x, weight, one_row)
            if out is not None:
                self.calls["rows"] += 1
                return out
        self.calls["split"] += 1
        return split_rows(gemm, x)


_ACTIVE: ContextVar[RowGemmPolicy | None] = ContextVar("lynx_row_gemm_policy", default=None)


@contextlib.contextmanager
def row_invariant_gemms(policy: RowGemmPolicy) -> Iterator[RowGemmPolicy]:
    """Inside: linear layers round each row as a decode step would (see module docstring)."""
    token = _ACTIVE.set(policy)
    try:
        yield policy
    finally:
        _ACTIVE.reset(token)


def rows_like_decode(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, weight: Any = None) -> torch.Tensor:
    """``gemm(x)`` under the active policy (plain ``gemm(x)`` when none is active); ``weight``: the LM
    head's [vocab, hidden] matrix, for the ``rows`` kernel."""
    policy = _ACTIVE.get()
    return gemm(x) if policy is None else policy.apply(gemm, x, weight, lm_head_one_row)


def _around_linear_apply(original: Any, method: Any, layer: Any, x: torch.Tensor, bias: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
    policy = _ACTIVE.get()
    if policy is None or args or kwargs or x.dim() != 2 or x.shape[0] <= 1:
        return original(method, layer, x, bias, *args, **kwargs)
    weight = getattr(layer, "weight", None) if bias is None else None
    return policy.apply(lambda rows: original(method, layer, rows, bias), x, weight, linear_one_row)


LINEAR_APPLY_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
ROW_GEMM_HOOKS = ((LINEAR_APPLY_TARGET, _around_linear_apply, "around"),)
