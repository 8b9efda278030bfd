"""The C CPU fast path of the lynx codec against the torch reference: identical bytes and pool values."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels import lynx_cpu_fast as fast

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

SMALL = LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8, group_size=16, sink_tokens=2)
CASES = [
    (300, 3, 64, torch.bfloat16, LayoutParams(), 0),
    (4096 + 77, 3, 64, torch.bfloat16, LayoutParams(), 1),
    (256, 1, 64, torch.float32, LayoutParams(), 2),
    (1, 2, 64, torch.float16, LayoutParams(), 3),
    (75, 2, 32, torch.float32, SMALL, 4),
    (40, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, key_chunk_tokens=4, sink_tokens=3), 5),
    (3, 1, 64, torch.float32, LayoutParams(page_tokens=16, chunk_tokens=4, key_chunk_tokens=4, sink_tokens=3), 6),
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", fast.CODEC_NAMES)
@pytest.mark.parametrize("value_group_size", [16, 32, 64])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_value_group_size_every_codec_name(kind, value_group_size, name) -> None:
    """Value groups are sized by ``value_group_size`` (the layout's ``token_group_field``), never ``group_size``.

    head_dim 128 keeps every size below head_dim, and group_size 128 would give other bytes if it were used."""
    params = LayoutParams(
        page_tokens=64, chunk_tokens=16, key_chunk_tokens=16,
        group_size=128, sink_tokens=2, value_group_size=value_group_size
    )
    x = _input(150, 2, 128, torch.bfloat16, seed=20 + value_group_size)
    codec = get_codec(name, **vars(params))
    ref = codec.encode(x, kind)
    got = fast.encode(x, kind, params=params, codec_name=name)
    assert got.codec == ref.codec == name
    assert torch.equal(got.anchor, ref.anchor), f"anchor: {(got.anchor != ref.anchor).sum()} bytes differ"
    assert torch.equal(got.residual, ref.residual), f"residual: {(got.residual != ref.residual).sum()} bytes differ"
    for with_residual in (False, True):
        want = codec.decode(ref, with_residual=with_residual, dtype=torch.bfloat16)
        assert torch.equal(fast.decode(ref, with_residual=with_residual, params=params), want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", fast.CODEC_NAMES)
def test_default_value_group_is_the_layouts(name) -> None:
    """Default params (value groups of 32 dims since the lever study): same bytes as the reference per codec name."""
    x = _input(300, 3, 64, torch.bfloat16, seed=30)
    codec = get_codec(name)
    for kind in ("k", "v"):
        ref = codec.encode(x, kind)
        got = fast.encode(x, kind, codec_name=name)
        assert torch.equal(got.anchor, ref.anchor) and torch.equal(got.residual, ref.residual)
        for with_residual in (False, True):
            want = codec.decode(ref, with_residual=with_residual, dtype=torch.float32)
            assert torch.equal(fast.decode(ref, with_residual=with_residual, dtype=torch.float32), want)


@pytest.mark.timeout(60)
def test_value_group_size_errors_match_the_reference() -> None:
    x = torch.randn(8, 1, 64)
    bad = LayoutParams(value_group_size=48)  # does not divide head_dim 64
    for kind in ("k", "v"):
        with pytest.raises(ValueError, match="value_group_size 48 does not divide head_dim 64"):
            get_codec("lynx", **vars(bad)).encode(x, kind)
        with pytest.raises(ValueError, match="value_group_size 48 does not divide head_dim 64"):
            fast.encode(x, kind, params=bad)
    with pytest.raises(ValueError, match="even value group size"):
        fast.encode(torch.randn(4, 4, 3), "v", params=LayoutParams(value_group_size=3))
