"""The chain verify's decode-like attention (fake backend): one decode-step call per input, at its own
position and slot, in order; selected only where it applies."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_lynx.integration.decode_verify import DECODE_LIKE_MAX_INPUTS, DecodeLikeVerifyAttention, verify_attention


class TorchNativeAttnBackend:  # the name is what verify_attention checks
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, bool]] = []
        self.token_to_kv_pool = "pool"

    def forward_decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       save_kv_cache: bool = True) -> torch.Tensor:
        assert q.shape[0] == 1 and k.shape[0] == 1 and v.shape[0] == 1
        self.calls.append((int(batch.seq_lens[0]), int(batch.out_cache_loc[0]), int(batch.req_pool_indices[0]),
                           save_kv_cache))
        return q * 2


class OtherBackend(TorchNativeAttnBackend):
    pass


def _batch(slots: list[int]) -> Any:
    return SimpleNamespace(out_cache_loc=torch.tensor(slots, dtype=torch.int64))


def test_each_input_runs_as_the_decode_step_of_its_position() -> None:
    inner = TorchNativeAttnBackend()
    attn = DecodeLikeVerifyAttention(inner, row=3, prefix_len=100, slots=torch.tensor([7, 9, 11]))
    q = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    out = attn.forward(q, torch.zeros(3, 4), torch.zeros(3, 4), SimpleNamespace(), None)
    assert torch.equal(out, q * 2)  # outputs in input order
    assert inner.calls == [(101, 7, 3, True), (102, 9, 3, True), (103, 11, 3, True)]
    assert attn.token_to_kv_pool == "pool"  # everything else is the wrapped backend's
    with pytest.raises(NotImplementedError):
        attn.forward(q, q, q, SimpleNamespace(is_cross_attention=True), None)


def test_selected_only_for_a_chain_after_a_prefix_on_the_cpu_backend() -> None:
    runner = SimpleNamespace(attn_backend=TorchNativeAttnBackend())
    assert isinstance(verify_attention(runner, 0, 10, _batch([1, 2])), DecodeLikeVerifyAttention)
    assert verify_attention(runner, 0, 0, _batch([1, 2])) is runner.attn_backend  # recompute: a prefill
    big = _batch(list(range(1, DECODE_LIKE_MAX_INPUTS + 2)))
    assert verify_attention(runner, 0, 10, big) is runner.attn_backend
    other = SimpleNamespace(attn_backend=OtherBackend())
    assert verify_attention(other, 0, 10, _batch([1])) is other.attn_backend
