"""The C CPU fast path of the lynx codec against the torch reference: identical bytes and pool values."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels import lynx_cpu_fast as fast

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

SMALL = LayoutParams(page_tokens=32, chunk_tokens=8, group_size=16, sink_tokens=2)
CASES = [
    (300, 3, 64, torch.bfloat16, LayoutParams(), 0),
    (4096 + 77, 3, 64, torch.bfloat16, LayoutParams(), 1),
    (256, 1, 64, torch.float32, LayoutParams(), 2),
    (1, 2, 64, torch.float16, LayoutParams(), 3),
    (75, 2, 32, torch.float32, SMALL, 4),
    (40, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, sink_tokens=3), 5),
    (3, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, sink_tokens=3), 6),
]


def _input(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = outlier_kv(tokens, heads, dim, seed=seed)
    x[0] += 50.0  # a sink far outside its chunk's range
    if tokens > 64:
        x[32:64] = -2.5  # constant page(s) / chunks
        x[:, heads - 1, : dim // 2] = 0.75  # constant channels and token groups
        x[40, 0, 3] = -9000.0
    return x.to(dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("tokens", "heads", "dim", "dtype", "params", "seed"), CASES)
def test_fast_path_identical_to_reference(kind, tokens, heads, dim, dtype, params, seed) -> None:
    x = _input(tokens, heads, dim, dtype, seed)
    codec = get_codec("lynx", **vars(params))
    ref = codec.encode(x, kind)
    got = fast.encode(x, kind, params=params)
    assert torch.equal(got.anchor, ref.anchor), f"anchor: {(got.anchor != ref.anchor).sum()} bytes differ"
    assert torch.equal(got.residual, ref.residual), f"residual: {(got.residual != ref.residual).sum()} bytes differ"
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(tokens + 5, generator=gen)[:tokens]
    for pool_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for with_residual in (False, True):
            pool = torch.full((tokens + 5, heads, dim), 7.0, dtype=pool_dtype)
            fast.decode_into(ref.anchor, ref.residual if with_residual else None, pool, slots, kind=kind, params=params)
            want = codec.decode(ref, with_residual=with_residual, dtype=pool_dtype)
            assert torch.equal(pool[slots], want), f"{pool_dtype} residual={with_residual}"
            untouched = torch.ones(tokens + 5, dtype=torch.bool)
            untouched[slots] = False
            assert bool((pool[untouched] == 7.0).all())


@pytest.mark.timeout(60)
def test_fast_path_int4_alpha_and_errors() -> None:
    x = outlier_kv(300, 3, 64, seed=9)
    assert fast.encode(x, "v", codec_name="lynx-int4").residual.numel() == 0
    ref = get_codec("lynx", alpha=3.0).encode(x, "k")
    got = fast.encode(x, "k", alpha=3.0)  # alpha > 0 is the reference itself
    assert torch.equal(got.anchor, ref.anchor) and torch.equal(got.residual, ref.residual)
    bad = x.clone()
    bad[260, 1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"layer 2 v: NaN or Inf in page 1"):
        fast.encode(bad, "v", layer=2)
    big = x.clone()
    big[270, 0, 0] = 50000.0
    with pytest.raises(ValueError, match=r"page 1: \|value\| up to 50000"):
        fast.encode(big, "k")
    enc = fast.encode(x, "k")
    pool = torch.zeros(300, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="anchor has"):
        fast.decode_into(enc.anchor[:-1], None, pool, torch.arange(300), kind="k")
    with pytest.raises(IndexError):
        fast.decode_into(enc.anchor, None, pool, torch.arange(300) + 1, kind="k")
