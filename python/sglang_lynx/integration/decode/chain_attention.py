"""Chain-verify attention on SGLang's CPU backend (``torch_native``): the row's KV gathered once per layer.

Why: the chain verify (``decode.verify``) is a DECODE batch of ``n`` virtual one-token requests on one
KV row. ``torch_native``'s decode attention handles a batch one request at a time and gathers each
request's whole K and V out of the pool (``k_cache[req_to_token[row, :len]]``) before its SDPA call:
for a chain of ``n`` inputs after a prefix of ``S`` tokens that is ``n`` gathers of ``S + i`` tokens per
layer, the same prefix copied ``n`` times (measured on this CPU, 1.4K-token prompt, 14 inputs: 0.12 s of
a 0.53 s verify, while a decode step's attention costs 0.015 s).

What: while :func:`chain_attention` is active (only inside a chain verify's decode-batch forward), the
backend's per-request decode loop is replaced, for that batch only, by: one gather of the row's
``S + n`` token slots per layer (after the layer wrote the chain's K/V, as the backend's own
``forward_decode`` does before its loop), then for input ``i`` the same SDPA call the backend makes on
the first ``S + i + 1`` rows of that gather. A leading slice of the gathered ``[tokens, heads, dim]``
tensor, moved to ``[heads, tokens, dim]``, has the shape, the strides and the start address the
backend's own gather of those tokens has, and holds the same values, so every SDPA call sees what the
decode step of that position sees (measured bit for bit: ``tests/decode/test_verify_bf16_exact.py``
compares the verify's logits and KV with decode steps). With a
:class:`~sglang_lynx.integration.decode.attention_kernel.ChainAttentionKernel` (``verify_attention =
"kernel"``, the default) those ``n`` calls become one pass of a C kernel over the gathered K/V that
computes what each call computes, bit for bit (checked at start-up and on each shape's first verify;
where it is not, the calls above).

Anything else passes through to the backend unchanged: a batch that is not the active chain (other
rows, other lengths), cross-attention, encoder lengths, a sliding window, a KV pool whose dtype
differs from the query's (the backend casts each gather), causal decode.

Invariants: outside the context the hook is one ContextVar read and a pass-through; inside, it reads
only the row's slots ``[0, S + n)`` after the layer's own KV write and writes only ``output``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.integration.decode.attention_kernel import ChainAttentionKernel
from sglang_lynx.kernels import lynx_chain_sdpa


@dataclass(frozen=True)
class Chain:
    """The chain being verified: ``n`` inputs on KV row ``row`` after ``prefix_len`` tokens."""

    row: int
    prefix_len: int
    n: int

    def matches(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        """Whether a decode batch is this chain (input ``i``: row ``row``, length ``prefix_len + i + 1``)."""
        if int(seq_lens.numel()) != self.n or int(req_pool_indices.numel()) != self.n:
            return False
        lens = seq_lens.to("cpu", torch.int64)
        want = torch.arange(self.prefix_len + 1, self.prefix_len + self.n + 1, dtype=torch.int64)
        return bool(torch.equal(lens, want)) and bool((req_pool_indices.to("cpu") == self.row).all())


_ACTIVE: ContextVar[tuple[Chain, ChainAttentionKernel | None] | None] = ContextVar("lynx_chain_attention",
                                                                                  default=None)


@contextlib.contextmanager
def chain_attention(chain: Chain, kernel: ChainAttentionKernel | None = None) -> Iterator[Chain]:
    """Inside: the CPU backend's decode attention of ``chain`` gathers the row once per layer (and runs on
    ``kernel`` where it serves)."""
    token = _ACTIVE.set((chain, kernel))
    try:
        yield chain
    finally:
        _ACTIVE.reset(token)


def chain_sdpa_decode(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      req_to_token: torch.Tensor, chain: Chain, scaling: float | None,
                      enable_gqa: bool, kernel: ChainAttentionKernel | None = None) -> torch.Tensor:
    """Decode attention of every chain input (``query``/``output``: ``[n, heads, dim]``; module docstring):
    by ``kernel`` (one pass over the K/V, equal to the per-input calls) where it serves, else one SDPA call
    per input."""
    tokens = req_to_token[chain.row, : chain.prefix_len + chain.n]
    k_rows, v_rows = k_cache[tokens], v_cache[tokens]  # [S + n, kv heads, dim]

    def per_input() -> torch.Tensor:
        return lynx_chain_sdpa.per_input_sdpa(query, k_rows, v_rows, chain.prefix_len, scaling,
                                              enable_gqa=enable_gqa, out=output)

    if kernel is None:
        return per_input()
    result = kernel.attend(query, k_rows, v_rows, chain.prefix_len, scaling, enable_gqa, per_input)
    if result is not output:
        output.copy_(result)
    return output


def _around_sdpa_forward_decode(original: Any, backend: Any, query: torch.Tensor, output: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, encoder_lens: Any = None,
                                *args: Any, **kwargs: Any) -> Any:
    active = _ACTIVE.get()
    chain, kernel = active if active is not None else (None, None)
    plain = (
        chain is None or args or encoder_lens is not None or kwargs.get("causal", False)
        or kwargs.get("is_cross_attn", False) or (kwargs.get("sliding_window_size") or -1) > -1
        or set(kwargs) - {"scaling", "enable_gqa", "causal", "is_cross_attn", "sliding_window_size"}
        or query.dim() != 3 or k_cache.dtype != query.dtype or v_cache.dtype != query.dtype
        or not chain.matches(req_pool_indices, seq_lens)
    )  # fmt: skip
    if plain:
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        encoder_lens, *args, **kwargs)  # fmt: skip
    assert chain is not None
    return chain_sdpa_decode(query, output, k_cache, v_cache, req_to_token, chain, kwargs.get("scaling"),
                             bool(kwargs.get("enable_gqa", False)), kernel)  # fmt: skip


SDPA_DECODE_TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode"
CHAIN_ATTENTION_HOOKS = ((SDPA_DECODE_TARGET, _around_sdpa_forward_decode, "around"),)
