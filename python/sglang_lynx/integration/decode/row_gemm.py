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
:func:`rows_like_decode`, computes each row as its own 1-row GEMM (policy ``split``, the default:
the decode step's computation by construction), or as SGLang's one batched GEMM (policy
``batched``: fewer weight reads, not exact where the GEMM is not row-invariant).

A probe that would batch only the shapes where random inputs showed the batched kernel rounding
like the 1-row kernel was tried and dropped: on this host it passed ``[16, 1536] x [1536, 576]`` on
random inputs while the same GEMM differed on the verify's real activations. Row equality of a
GEMM is not a property of its shape that a probe can establish.

Invariants: outside the context the hook is a pass-through (one ContextVar read); with ``split``
the result is the 1-row computation by construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

POLICIES = ("split", "batched")


class RowGemmPolicy:
    """How a verify forward multiplies its rows: one 1-row GEMM each (``split``), or batched."""

    def __init__(self, policy: str = "split") -> None:
        if policy not in POLICIES:
            raise ValueError(f"row GEMM policy {policy!r}: valid {', '.join(POLICIES)}")
        self.policy = policy
        self.calls = {"batched": 0, "split": 0}

    def apply(self, gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``gemm(x)``; under ``split`` every row rounded as a 1-row GEMM rounds it."""
        if x.dim() != 2 or x.shape[0] <= 1 or self.policy == "batched":
            self.calls["batched"] += 1
            return gemm(x)
        self.calls["split"] += 1
        return torch.cat([gemm(x[i: i + 1]) for i in range(int(x.shape[0]))], dim=0)


_ACTIVE: ContextVar[RowGemmPolicy | None] = ContextVar("lynx_row_gemm_policy", default=None)


@contextlib.contextmanager
def row_invariant_gemms(policy: RowGemmPolicy) -> Iterator[RowGemmPolicy]:
    """Inside: linear layers round each row as a decode step would (see module docstring)."""
    token = _ACTIVE.set(policy)
    try:
        yield policy
    finally:
        _ACTIVE.reset(token)


def rows_like_decode(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` under the active policy (plain ``gemm(x)`` when none is active)."""
    policy = _ACTIVE.get()
    return gemm(x) if policy is None else policy.apply(gemm, x)


def _around_linear_apply(original: Any, method: Any, layer: Any, x: torch.Tensor, bias: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
    policy = _ACTIVE.get()
    if policy is None or args or kwargs or x.dim() != 2 or x.shape[0] <= 1:
        return original(method, layer, x, bias, *args, **kwargs)
    return policy.apply(lambda rows: original(method, layer, rows, bias), x)


LINEAR_APPLY_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
ROW_GEMM_HOOKS = ((LINEAR_APPLY_TARGET, _around_linear_apply, "around"),)
