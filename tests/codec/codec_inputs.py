"""Shared inputs of the codec tests (a plain module, not a conftest: `from conftest import` resolved to
whichever conftest.py pytest had imported first)."""

from __future__ import annotations

import torch


def outlier_kv(tokens: int, heads: int = 3, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Keys-like data: per-channel offsets and scales, one heavy outlier channel, a few spikes."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(heads, dim, generator=gen) * 3 + 0.1
    offset = torch.randn(heads, dim, generator=gen) * 2
    x = torch.randn(tokens, heads, dim, generator=gen) * scale + offset
    x[:, 0, 5] += 40.0
    if tokens:
        x[torch.randint(0, tokens, (3,), generator=gen), 1, 7] = 300.0
    return x
