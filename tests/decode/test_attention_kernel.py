"""The verify's chain attention policy (``integration.decode.attention_kernel``), unit tier: what it hands
back is always what the per-input SDPA calls compute. With the real kernel: equal on random inputs, the
first use of a shape checked, a shape whose check fails kept on the per-input calls; without it (not
built, self-check failed, a call it does not cover, a kernel error): the per-input calls, counted."""

from __future__ import annotations

import pytest
import torch
from sglang_lynx.kernels import lynx_chain_sdpa

from sglang_lynx.integration.decode import attention_kernel as ak
from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel

needs_kernel = pytest.mark.skipif(not lynx_chain_sdpa.available(), reason="chain attention kernel not available")


def _inputs(n: int = 4, prefix_len: int = 30, heads: int = 9, kv_heads: int = 3, dtype: torch.dtype = torch.bfloat16,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, 64, generator=g).to(dtype)
    k = torch.randn(prefix_len + n, kv_heads, 64, generator=g).to(dtype)
    v = torch.randn(prefix_len + n, kv_heads, 64, generator=g).to(dtype)
    return q, k, v


def _per_input(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, log: list[str]):  # type: ignore[no-untyped-def]
    def run() -> torch.Tensor:
        log.append("per-input")
        return lynx_chain_sdpa.per_input_sdpa(q, k, v, prefix_len, 0.125)
    return run


@needs_kernel
def test_the_kernel_serves_after_the_first_use_of_a_shape_and_equals_the_calls() -> None:
    kernel, log = ChainAttentionKernel(), []
    assert kernel.prepare()
    for seed in range(3):
        q, k, v = _inputs(seed=seed)
        got = kernel.attend(q, k, v, 30, 0.125, True, _per_input(q, k, v, 30, log))
        assert torch.equal(got.view(torch.int16), lynx_chain_sdpa.per_input_sdpa(q, k, v, 30, 0.125).view(torch.int16))
    assert log == ["per-input"]  # the first use only
    assert kernel.calls == {"kernel": 2, "per-input": 1}


@needs_kernel
def test_a_shape_whose_first_use_differs_keeps_the_per_input_calls() -> None:
    kernel, log = ChainAttentionKernel(), []
    q, k, v = _inputs()

    def differs() -> torch.Tensor:
        log.append("per-input")
        out = lynx_chain_sdpa.per_input_sdpa(q, k, v, 30, 0.125)
        out.view(torch.int16)[0, 0, 0] ^= 1  # one bit
        return out

    first = kernel.attend(q, k, v, 30, 0.125, True, differs)
    assert first.view(torch.int16)[0, 0, 0] == differs().view(torch.int16)[0, 0, 0]  # the calls' result
    kernel.attend(q, k, v, 30, 0.125, True, differs)
    assert kernel.calls == {"kernel": 0, "per-input": 2}
    q2, k2, v2 = _inputs(heads=4, kv_heads=4)  # another shape is checked on its own
    kernel.attend(q2, k2, v2, 30, 0.125, False, _per_input(q2, k2, v2, 30, log))
    kernel.attend(q2, k2, v2, 30, 0.125, False, _per_input(q2, k2, v2, 30, log))
    assert kernel.calls == {"kernel": 1, "per-input": 3}


@needs_kernel
@pytest.mark.parametrize("case", ["fp32", "heads without gqa", "odd head dim"])
def test_calls_the_kernel_does_not_cover_go_to_the_per_input_calls(case: str) -> None:
    kernel, log = ChainAttentionKernel(), []
    q, k, v = _inputs(dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "odd head dim":
        q, k, v = q[..., :40], k[..., :40], v[..., :40]
    sentinel = torch.zeros(1)

    def run() -> torch.Tensor:
        log.append("per-input")
        return sentinel

    assert kernel.attend(q, k, v, 30, 0.125, case != "heads without gqa", run) is sentinel
    assert log == ["per-input"] and kernel.calls == {"kernel": 0, "per-input": 1}


def test_without_the_kernel_or_its_self_check_every_chain_is_per_input(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _inputs()
    log: list[str] = []
    monkeypatch.setattr(ak.lynx_chain_sdpa, "matches_torch", lambda threads=None: False)
    checked = ChainAttentionKernel()
    assert not checked.prepare() and checked.checked
    monkeypatch.setattr(ak.lynx_chain_sdpa, "available", lambda: False)
    missing = ChainAttentionKernel()
    for kernel in (checked, missing):
        for _ in range(2):
            kernel.attend(q, k, v, 30, 0.125, True, _per_input(q, k, v, 30, log))
        assert kernel.calls == {"kernel": 0, "per-input": 2}


def test_a_kernel_error_keeps_that_shape_on_the_per_input_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _inputs()
    log: list[str] = []
    monkeypatch.setattr(ak.lynx_chain_sdpa, "available", lambda: True)
    monkeypatch.setattr(ak.lynx_chain_sdpa, "matches_torch", lambda threads=None: True)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("the chain attention kernel failed (code 3)")

    monkeypatch.setattr(ak.lynx_chain_sdpa, "chain_sdpa", broken)
    kernel = ChainAttentionKernel()
    for _ in range(2):
        kernel.attend(q, k, v, 30, 0.125, True, _per_input(q, k, v, 30, log))
    assert kernel.calls == {"kernel": 0, "per-input": 2} and log == ["per-input"] * 2


def test_the_config_names_the_attention_policies() -> None:
    from sglang_lynx.config import LynxConfig, LynxConfigError

    assert LynxConfig().verify_attention == "kernel"
    assert LynxConfig(verify_attention="per-input").verify_attention == "per-input"
    with pytest.raises(LynxConfigError, match="verify_attention"):
        LynxConfig(verify_attention="batched")
