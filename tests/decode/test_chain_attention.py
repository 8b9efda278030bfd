"""The chain verify's CPU decode attention (``integration.decode.chain_attention``) against SGLang's own.

Bit for bit against ``TorchNativeAttnBackend._run_sdpa_forward_decode`` (the pinned SGLang's loop, one
gather per request) on random pools, in bf16 and fp32, with grouped-query heads, with and without the
chain attention kernel (``integration.decode.attention_kernel``); and the hook's dispatch: the chain path
only for the active chain, the backend's own loop for everything else.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel  # noqa: E402
from sglang_lynx.integration.decode.chain_attention import (  # noqa: E402
    Chain,
    _around_sdpa_forward_decode,
    chain_attention,
    chain_sdpa_decode,
)

HEADS_Q, HEADS_KV, DIM = 9, 3, 64


def _pools(dtype: torch.dtype, pool: int = 700, rows: int = 4, width: int = 600, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool, HEADS_KV, DIM, generator=g).to(dtype)
    v_cache = torch.randn(pool, HEADS_KV, DIM, generator=g).to(dtype)
    req_to_token = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        req_to_token[r] = (torch.randperm(pool - 1, generator=g)[:width] + 1).to(torch.int32)
    return k_cache, v_cache, req_to_token, g


def _backend_loop(query, k_cache, v_cache, req_to_token, chain, gqa):  # type: ignore[no-untyped-def]
    output = torch.empty_like(query)
    backend = object.__new__(TorchNativeAttnBackend)
    req_pool_indices = torch.full((chain.n,), chain.row, dtype=torch.int64)
    seq_lens = torch.arange(chain.prefix_len + 1, chain.prefix_len + chain.n + 1, dtype=torch.int64)
    return backend._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                            seq_lens, None, scaling=DIM ** -0.5, enable_gqa=gqa, causal=False,
                                            is_cross_attn=False, sliding_window_size=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("prefix_len", "n"), [(1, 1), (37, 5), (513, 16), (520, 64)])
def test_chain_attention_equals_the_backend_loop_bit_for_bit(dtype: torch.dtype, prefix_len: int, n: int) -> None:
    k_cache, v_cache, req_to_token, g = _pools(dtype, seed=prefix_len + n)
    chain = Chain(row=2, prefix_len=prefix_len, n=n)
    for heads_q in (HEADS_Q, HEADS_KV):
        query = torch.randn(n, heads_q, DIM, generator=g).to(dtype)
        gqa = heads_q != HEADS_KV
        want = _backend_loop(query, k_cache, v_cache, req_to_token, chain, gqa)
        got = chain_sdpa_decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, chain, DIM ** -0.5, gqa)
        assert torch.equal(got.view(torch.uint8) if dtype == torch.bfloat16 else got, want.view(torch.uint8)
                           if dtype == torch.bfloat16 else want)  # fmt: skip


@pytest.mark.parametrize(("prefix_len", "n"), [(1, 1), (37, 5), (513, 16), (520, 64)])
def test_the_chain_attention_kernel_equals_the_backend_loop_bit_for_bit(prefix_len: int, n: int) -> None:
    kernel = ChainAttentionKernel()
    if not kernel.prepare():
        pytest.skip("the chain attention kernel does not serve on this host (not built, or its self-check failed)")
    k_cache, v_cache, req_to_token, g = _pools(torch.bfloat16, seed=prefix_len + n)
    chain = Chain(row=1, prefix_len=prefix_len, n=n)
    for heads_q in (HEADS_Q, HEADS_KV):  # two shapes: each checked on its first use, then the kernel's
        gqa = heads_q != HEADS_KV
        for _ in range(2):
            query = torch.randn(n, heads_q, DIM, generator=g).bfloat16()
            want = _backend_loop(query, k_cache, v_cache, req_to_token, chain, gqa)
            got = chain_sdpa_decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, chain,
                                    DIM ** -0.5, gqa, kernel)  # fmt: skip
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert kernel.calls == {"kernel": 2, "per-input": 2}


def _call_hook(original, seq_lens, rows, **kwargs):  # type: ignore[no-untyped-def]
    k_cache, v_cache, req_to_token, g = _pools(torch.bfloat16)
    query = torch.randn(int(seq_lens.numel()), HEADS_Q, DIM, generator=g).bfloat16()
    args = dict(scaling=DIM ** -0.5, enable_gqa=True, causal=False, is_cross_attn=False, sliding_window_size=None)
    args.update(kwargs)
    return _around_sdpa_forward_decode(original, object(), query, torch.empty_like(query), k_cache, v_cache,
                                       req_to_token, rows, seq_lens, None, **args)  # fmt: skip


def test_the_hook_hands_the_active_kernel_to_the_chain_path() -> None:
    class Recording(ChainAttentionKernel):
        def attend(self, q, keys, values, prefix_len, scale, enable_gqa, per_input):  # type: ignore[no-untyped-def]
            self.seen = (tuple(q.shape), tuple(keys.shape), prefix_len, scale, enable_gqa)
            return per_input()

    def original(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the active chain must not reach the backend's loop")

    kernel = Recording()
    with chain_attention(Chain(row=2, prefix_len=40, n=5), kernel):
        _call_hook(original, torch.arange(41, 46), torch.full((5,), 2))
    assert kernel.seen == ((5, HEADS_Q, DIM), (45, HEADS_KV, DIM), 40, DIM ** -0.5, True)


def test_the_hook_takes_the_chain_path_only_for_the_active_chain() -> None:
    calls: list[str] = []

    def original(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("backend")
        return args[2]

    lens, rows = torch.arange(41, 46), torch.full((5,), 2)
    _call_hook(original, lens, rows)  # no chain active
    assert calls == ["backend"]
    with chain_attention(Chain(row=2, prefix_len=40, n=5)):
        _call_hook(original, lens, rows)
        assert calls == ["backend"], "the active chain must not reach the backend's loop"
        _call_hook(original, lens + 1, rows)  # other lengths
        _call_hook(original, lens, torch.full((5,), 3))  # another row
        _call_hook(original, lens, rows, sliding_window_size=16)  # a sliding window
        _call_hook(original, lens, rows, is_cross_attn=True)
    assert calls == ["backend"] * 5
    _call_hook(original, lens, rows)  # the context is gone
    assert calls == ["backend"] * 6
