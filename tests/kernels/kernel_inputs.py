"""Inputs and checks shared by the kernel tests (fixed seeds)."""

from __future__ import annotations

from types import ModuleType

import torch

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

#: Layouts with ``lynx``'s layer trailer (``recent_tokens``): a small one and the default.
TRAILER_PARAMS = [
    LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8,
                 value_group_size=16, sink_tokens=2, recent_tokens=40),
    LayoutParams(recent_tokens=48),
]


def outlier_kv(tokens: int, heads: int = 3, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Keys-like data: per-channel offsets and scales, one heavy outlier channel, a few spikes."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(heads, dim, generator=gen) * 3 + 0.1
    offset = torch.randn(heads, dim, generator=gen) * 2
    x = torch.randn(tokens, heads, dim, generator=gen) * scale + offset
    x[:, 0, 5] += 40.0
    if tokens:
        x[torch.randint(0, tokens, (3,), generator=gen), heads - 1, 7] = 300.0
    return x


def check_kernel_module_with_trailer(module: ModuleType, x: torch.Tensor, kind: str, params: LayoutParams,
                                     name: str) -> None:
    """``module`` (C fast path or Triton) encodes byte-identically to the reference codec and its
    ``decode_into`` writes exactly the reference decode, anchor-only and (``lynx``) full."""
    codec = get_codec(name, **vars(params))
    ref = codec.encode(x, kind)
    got = module.encode(x, kind, params=params, codec_name=name)
    assert torch.equal(got.anchor, ref.anchor) and torch.equal(got.residual, ref.residual)
    tokens = x.shape[0]
    slots = torch.randperm(tokens + 5, generator=torch.Generator().manual_seed(1))[:tokens]
    for with_residual in (False, True) if name != "lynx-int4" else (False,):
        pool = torch.zeros(tokens + 5, *x.shape[1:], dtype=torch.bfloat16)
        module.decode_into(ref.anchor, ref.residual if with_residual else None, pool, slots, kind=kind, params=params)
        assert torch.equal(pool[slots], codec.decode(ref, with_residual=with_residual, dtype=torch.bfloat16))
