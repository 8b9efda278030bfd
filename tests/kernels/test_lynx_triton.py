"""Triton lynx kernels (interpreted on the CPU) against the torch reference codec.

Equality contract (measured here): with alpha = 0 the anchor and residual streams are byte-identical
and decode_into writes exactly ``codec.decode(...).to(pool.dtype)``; with alpha > 0 (companding) a
code may differ by one step where log1p / expm1 round differently (counted and bounded below).
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_inputs import TRAILER_PARAMS, check_kernel_module_with_trailer, outlier_kv

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

SMALL = LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8, group_size=16, sink_tokens=2)


def _check_encode(lt: ModuleType, x: torch.Tensor, kind: str, params: LayoutParams, name: str = "lynx") -> None:
    codec = get_codec(name, **vars(params))
    ref = codec.encode(x, kind)
    got = lt.encode(x, kind, params=params, codec_name=name)
    assert got.anchor.shape == ref.anchor.shape and got.residual.shape == ref.residual.shape
    assert torch.equal(got.anchor, ref.anchor), f"anchor bytes differ at {(got.anchor != ref.anchor).sum()} places"
    assert torch.equal(got.residual, ref.residual), "residual bytes differ"


def _check_decode(lt: ModuleType, x: torch.Tensor, kind: str, params: LayoutParams, pool_dtype: torch.dtype) -> None:
    codec = get_codec("lynx", **vars(params))
    enc = codec.encode(x, kind)
    tokens, heads, dim = x.shape
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(tokens + 7, generator=gen)[:tokens]
    for with_residual in (False, True):
        pool = torch.full((tokens + 7, heads, dim), 123.0, dtype=pool_dtype)
        lt.decode_into(enc.anchor, enc.residual if with_residual else None, pool, slots, kind=kind, params=params)
        want = codec.decode(enc, with_residual=with_residual, dtype=pool_dtype)
        assert torch.equal(pool[slots], want), f"with_residual={with_residual}: {(pool[slots] != want).sum()} differ"
        untouched = torch.ones(tokens + 7, dtype=torch.bool)
        untouched[slots] = False
        assert bool((pool[untouched] == 123.0).all()), "slots outside slot_indices were written"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(
    ("tokens", "heads", "dtype", "seed"),
    [(300, 3, torch.bfloat16, 0), (256, 1, torch.float32, 1), (1, 2, torch.float16, 2)],
)
def test_encode_default_params_byte_identical(lynx_triton, kind, tokens, heads, dtype, seed) -> None:
    """Default layout (P=256, C=32, value groups G=32, S=1): partial last page/chunk (300), a full page, one token."""
    x = outlier_kv(tokens, heads, 64, seed=seed).to(dtype)
    _check_encode(lynx_triton, x, kind, LayoutParams())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_encode_small_pages_constant_channels_and_outliers(lynx_triton, kind) -> None:
    """Many small pages (P=32, C=8, G=16, S=2), constant channels and pages, heavy outliers, partial page."""
    x = outlier_kv(75, 2, 32, seed=3)
    x[:, 1, :] = 0.75  # a constant head: constant channels (keys) and constant token groups (values)
    x[32:64] = -2.5  # one whole constant page
    x[5, 0, 3] = -9000.0  # a heavy outlier that stays inside the fp16 range
    _check_encode(lynx_triton, x, kind, SMALL)
    _check_encode(lynx_triton, x, kind, SMALL, name="lynx-int4")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sink", [0, 3])
def test_encode_sink_rule_and_tiny_pages(lynx_triton, sink) -> None:
    """Keys of page 0 leave the sink out of the statistics; S=3 with a 3-token input keeps them."""
    params = LayoutParams(page_tokens=16, chunk_tokens=4, key_chunk_tokens=4, group_size=64, sink_tokens=sink)
    for tokens in (3, 40):
        x = outlier_kv(tokens, 1, 64, seed=4 + tokens)
        x[0] += 50.0  # a sink far outside the chunk range
        _check_encode(lynx_triton, x, "k", params)
        _check_encode(lynx_triton, x, "v", params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_into_pool_equals_reference(lynx_triton, pool_dtype) -> None:
    x = outlier_kv(300, 3, 64, seed=5).to(torch.bfloat16)
    for kind in ("k", "v"):
        _check_decode(lynx_triton, x, kind, LayoutParams(), pool_dtype)


@pytest.mark.timeout(120)
def test_decode_small_pages_and_upgrade_in_place(lynx_triton) -> None:
    x = outlier_kv(75, 2, 32, seed=6)
    x[32:64] = -2.5
    for kind in ("k", "v"):
        _check_decode(lynx_triton, x, kind, SMALL, torch.bfloat16)
    codec = get_codec("lynx", **vars(SMALL))
    enc = codec.encode(x, "k")
    pool = torch.zeros(75, 2, 32, dtype=torch.float32)
    slots = torch.arange(75)
    lynx_triton.decode_into(enc.anchor, None, pool, slots, kind="k", params=SMALL)
    lynx_triton.decode_into(enc.anchor, enc.residual, pool, slots, kind="k", params=SMALL)  # upgrade in place
    assert torch.equal(pool, codec.decode(enc, with_residual=True, dtype=torch.float32))
    assert torch.equal(pool[32:64], x[32:64]), "a constant page must round-trip exactly"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pairs", [4, 16, 1024])
def test_key_kernels_tiled_over_channel_pairs(lynx_triton, pairs) -> None:
    """The key kernels split the channels over programs (``pairs_per_program`` pairs each; 3 x 40 channels
    = 60 pairs: 15 blocks of 4, 4 of 16 with a partial last one, or one block): the same bytes and
    values as the reference, and the fp16-range check sees a peak in any block."""
    x = outlier_kv(100, 3, 40, seed=8)
    params = LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=16, value_group_size=8, sink_tokens=2)
    codec = get_codec("lynx", **vars(params))
    ref = codec.encode(x, "k")
    got = lynx_triton.encode(x, "k", params=params, pairs_per_program=pairs)
    assert torch.equal(got.anchor, ref.anchor) and torch.equal(got.residual, ref.residual)
    slots = torch.randperm(110, generator=torch.Generator().manual_seed(8))[:100]
    for residual in (None, ref.residual):
        pool = torch.zeros(110, 3, 40, dtype=torch.bfloat16)
        lynx_triton.decode_into(ref.anchor, residual, pool, slots, kind="k", params=params, pairs_per_program=pairs)
        want = codec.decode(ref, with_residual=residual is not None, dtype=torch.bfloat16)
        assert torch.equal(pool[slots], want)
    big = x.clone()
    big[70, 2, 39] = 70000.0  # the last channel pair: the last block
    with pytest.raises(ValueError, match=r"k page 2: \|value\| up to 70000"):
        lynx_triton.encode(big, "k", params=params, pairs_per_program=pairs)
    with pytest.raises(ValueError, match="power of two"):
        lynx_triton.encode(x, "k", params=params, pairs_per_program=6)


@pytest.mark.timeout(180)
def test_alpha_codes_within_one_step(lynx_triton) -> None:
    """Companding (alpha > 0): codes within one step of the reference; how often they differ is bounded."""
    torch.manual_seed(7)
    x = outlier_kv(300, 2, 64, seed=7)
    total = differ = 0
    for alpha in (0.5, 3.0, 20.0):
        codec = get_codec("lynx", alpha=alpha)
        for kind in ("k", "v"):
            ref = codec.encode(x, kind)
            got = lynx_triton.encode(x, kind, alpha=alpha)
            for a, b in ((got.anchor, ref.anchor), (got.residual, ref.residual)):
                assert a.shape == b.shape
                # compare nibble codes (metadata bytes are identical: they do not depend on alpha)
                ca = torch.stack([a & 15, a >> 4]).to(torch.int16)
                cb = torch.stack([b & 15, b >> 4]).to(torch.int16)
                assert int((ca - cb).abs().max()) <= 1
                total += ca.numel()
                differ += int((ca != cb).sum())
    print(f"alpha>0: {differ} of {total} nibbles differ by one step ({differ / total:.2e})")
    assert differ / total < 1e-3


@pytest.mark.timeout(60)
def test_bad_input_clear_errors(lynx_triton) -> None:
    x = torch.randn(40, 1, 64)
    x[33, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer 4 k: NaN or Inf in page 1"):
        lynx_triton.encode(x, "k", layer=4, params=SMALL)
    big = torch.randn(40, 1, 64)
    big[35, 0, 1] = 40000.0
    with pytest.raises(ValueError, match=r"page 1: \|value\| up to 40000"):
        lynx_triton.encode(big, "v", params=SMALL)
    with pytest.raises(ValueError, match="even value group size"):
        lynx_triton.encode(torch.randn(4, 4, 3), "v", params=LayoutParams(value_group_size=3))
    for kind in ("k", "v"):  # the reference rejects a value group that does not divide head_dim for both kinds
        with pytest.raises(ValueError, match="value_group_size 48 does not divide head_dim 64"):
            lynx_triton.encode(torch.randn(8, 1, 64), kind, params=LayoutParams(value_group_size=48))
    enc = lynx_triton.encode(torch.randn(40, 1, 64), "k", params=SMALL)
    pool = torch.zeros(40, 1, 64)
    with pytest.raises(ValueError, match="anchor has"):
        lynx_triton.decode_into(enc.anchor[:-1], None, pool, torch.arange(40), kind="k", params=SMALL)
    with pytest.raises(ValueError, match="residual has"):
        lynx_triton.decode_into(enc.anchor, enc.residual[:-2], pool, torch.arange(40), kind="k", params=SMALL)
    with pytest.raises(IndexError, match="slot_indices"):
        lynx_triton.decode_into(enc.anchor, None, pool, torch.arange(40) + 1, kind="k", params=SMALL)
    with pytest.raises(TypeError, match="int64"):
        lynx_triton.decode_into(enc.anchor, None, pool, torch.arange(40, dtype=torch.int32), kind="k", params=SMALL)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("value_group_size", [16, 32, 64])
def test_value_group_size_every_codec_name(lynx_triton, value_group_size) -> None:
    """Value groups are sized by ``value_group_size`` (the layout's ``token_group_field``), never ``group_size``:
    head_dim 128 keeps every size below head_dim, and group_size 128 would give other bytes if it were used."""
    params = LayoutParams(
        page_tokens=32, chunk_tokens=8, key_chunk_tokens=8, group_size=128, sink_tokens=2,
        value_group_size=value_group_size,
    )
    x = outlier_kv(45, 1, 128, seed=10 + value_group_size)
    x[0] += 50.0
    for name in lynx_triton.CODEC_NAMES:
        _check_encode(lynx_triton, x, "v", params, name=name)
    _check_encode(lynx_triton, x, "k", params, name="lynx")
    _check_decode(lynx_triton, x, "v", params, torch.bfloat16)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["lynx-int8", "lynx-int4"])
def test_default_params_aliases_byte_identical(lynx_triton, name) -> None:
    """Default params (value groups of 32 dims) for the codec names beside ``lynx`` (covered above)."""
    x = outlier_kv(300, 2, 64, seed=11).to(torch.bfloat16)
    for kind in ("k", "v"):
        _check_encode(lynx_triton, x, kind, LayoutParams(), name=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
def test_triton_matches_the_reference_with_a_trailer(lynx_triton: ModuleType, kind: str, name: str) -> None:
    x = outlier_kv(70, 2, 64, seed=4).to(torch.bfloat16)
    check_kernel_module_with_trailer(lynx_triton, x, kind, TRAILER_PARAMS[0], name)


def test_the_transport_request_path_with_the_triton_kernels_equals_the_reference(lynx_triton: ModuleType) -> None:
    """What a CUDA server runs (``integration.transport.codec``), here on the interpreter: a whole
    request's streams, and its anchor-only then full decode into pool slots, as the reference."""
    from sglang_lynx.codec.request import decode_request_into, encode_request
    from sglang_lynx.config import LynxConfig
    from sglang_lynx.integration.transport.codec import decode_with_kernels, encode_with_kernels

    config = LynxConfig(mode="lynx", page_tokens=32, chunk_tokens=8, key_chunk_tokens=8, recent_tokens=4)
    codec = get_codec(config.codec_name, **config.codec_params())
    gen = torch.Generator().manual_seed(5)
    k = [torch.randn(70, 2, 32, generator=gen).bfloat16() for _ in range(2)]
    v = [torch.randn(70, 2, 32, generator=gen).bfloat16() for _ in range(2)]
    want = encode_request(k, v, codec)
    anchor, residual = encode_with_kernels(lynx_triton, k, v, codec, config)
    assert torch.equal(anchor, want.anchor) and torch.equal(residual, want.residual)
    slots = torch.randperm(80, generator=gen)[:70]
    for with_residual in (False, True):
        got = [torch.zeros(80, 2, 32, dtype=torch.bfloat16) for _ in range(4)]
        ref = [torch.zeros(80, 2, 32, dtype=torch.bfloat16) for _ in range(4)]
        decode_with_kernels(lynx_triton, anchor, residual if with_residual else None, got[:2], got[2:], slots, codec,
                            config)
        decode_request_into((want.anchor, want.residual if with_residual else None), ref[:2], ref[2:], slots,
                            with_residual=with_residual, codec=codec)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)
