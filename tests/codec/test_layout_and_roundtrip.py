"""Stream sizes match the layout table; every codec round-trips within its documented bound."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.layout import LayoutParams, bits_per_value, scheme_layout, stream_bytes, wire_bits_per_value
from sglang_lynx.codec.registry import codec_names, get_codec

SMALL = {"page_tokens": 64, "chunk_tokens": 16, "key_chunk_tokens": 16, "group_size": 32, "sink_tokens": 1}


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("tokens", [1, 15, 64, 64 * 3 + 17])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_stream_sizes_match_layout(name: str, tokens: int, kind: str) -> None:
    codec = get_codec(name, **SMALL)
    x = outlier_kv(tokens, 2, 32)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    sizes = stream_bytes(name, tokens, 2, 32, kind, LayoutParams(**SMALL))  # type: ignore[arg-type]
    assert (enc.anchor.numel(), enc.residual.numel()) == sizes
    assert enc.anchor.dtype == torch.uint8 and enc.anchor.is_contiguous()
    y = codec.decode(enc, with_residual=True, dtype=torch.float32)
    assert y.shape == x.shape and torch.isfinite(y).all()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kind", ["k", "v"])
def test_error_ordering_on_outlier_data(kind: str) -> None:
    x = outlier_kv(300, seed=3)
    errs = {}
    for name in codec_names():
        codec = get_codec(name, **SMALL)
        enc = codec.encode(x, kind)  # type: ignore[arg-type]
        errs[name, False] = rel_err(codec.decode(enc, with_residual=False, dtype=torch.float32), x)
        errs[name, True] = rel_err(codec.decode(enc, with_residual=True, dtype=torch.float32), x)
    assert errs["bf16", True] < 0.005
    assert errs["int8", True] < errs["int4", True] < errs["kivi-int2", True]
    assert errs["lynx", True] < errs["lynx", False] / 8  # the residual refines by ~15x
    assert errs["lynx-int8", True] == errs["lynx", True]
    assert errs["lynx-int4", True] == errs["lynx", False]  # int4 never uses a residual
    assert errs["lynx-paper", True] < errs["lynx-paper", False] / 8


def test_sink_tokens_are_exact_in_lynx() -> None:
    x = outlier_kv(100, seed=5).to(torch.bfloat16)
    x[0] *= 50
    for sink in (1, 4):
        codec = get_codec("lynx", **{**SMALL, "sink_tokens": sink})
        y = codec.decode(codec.encode(x, "k"), with_residual=False)
        assert torch.equal(y[:sink], x[:sink])
        assert not torch.equal(y[sink : sink + 4], x[sink : sink + 4])


def test_bits_per_value_counts_metadata() -> None:
    anchor, residual = bits_per_value("lynx", 1024, 3, 64)
    # keys per channel in chunks of 64 tokens, values in groups of 64 dims: fp16 min + range = 0.5 bits each
    assert anchor == pytest.approx((4.5 + 4.5) / 2 + 16 / 1024 + 4 * 48 / 1024)  # + the 48-token trailer
    assert anchor <= 4.75  # issue 14: the anchor in no more than 4.75 bits/value at 1K tokens
    no_trailer = LayoutParams(value_group_size=32, key_chunk_tokens=32, recent_tokens=0)  # the groups before
    assert bits_per_value("lynx", 1024, 3, 64, no_trailer)[0] == pytest.approx(5.0 + 16 / 1024)
    assert residual == 4.0
    assert bits_per_value("int4", 1024, 3, 64) == (4.5, 0.0)
    assert bits_per_value("lynx-paper", 1024, 3, 64)[0] == pytest.approx(4 + 1.125)


def test_bits_on_the_wire_leave_out_the_residual_the_trailer_carries() -> None:
    anchor, residual = wire_bits_per_value("lynx", 1024, 3, 64)
    assert anchor == bits_per_value("lynx", 1024, 3, 64)[0]
    assert residual == pytest.approx(4.0 - 4 * 48 / 1024)
    assert wire_bits_per_value("lynx", 48, 3, 64) == bits_per_value("lynx", 48, 3, 64)  # sent whole: T <= R
    assert wire_bits_per_value("lynx-int4", 1024, 3, 64) == bits_per_value("lynx-int4", 1024, 3, 64)
    for name in ("int8", "kivi-int4", "lynx-paper", "bf16"):
        assert wire_bits_per_value(name, 1024, 3, 64) == bits_per_value(name, 1024, 3, 64)


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_constant_groups_and_pages_are_exact(name: str, dtype: torch.dtype) -> None:
    """Constant pages: exact everywhere. Constant channels: exact where groups run along a channel
    (lynx / kivi keys, lynx-paper); constant (token, head) rows: exact where groups run along a token."""
    codec = get_codec(name, **SMALL)
    x = torch.randn(150, 2, 32)
    x[:, 0, 3] = 1.75
    x[:, 1, :] = -0.3125
    x[64:128] = 2.5  # one whole constant page
    x = x.to(dtype)
    layout = scheme_layout(name)
    for kind in ("k", "v"):
        for with_residual in (False, True):
            y = codec.decode(codec.encode(x, kind), with_residual=with_residual, dtype=dtype)  # type: ignore[arg-type]
            assert torch.equal(y[64:128], x[64:128]), (kind, with_residual)
            grouping = layout.grouping(kind)  # type: ignore[arg-type]
            if grouping in ("channel", "none"):
                assert torch.equal(y[:, 0, 3], x[:, 0, 3]), (kind, with_residual)
            if grouping in ("token", "none"):
                assert torch.equal(y[:, 1], x[:, 1]), (kind, with_residual)


def test_decode_writes_into_a_strided_pool_view() -> None:
    codec = get_codec("lynx", **SMALL)
    x = outlier_kv(70, 2, 32)
    enc = codec.encode(x, "v")
    pool = torch.zeros(200, 2, 32, dtype=torch.float16)
    view = pool[10:150:2]
    out = codec.decode(enc, with_residual=True, out=view)
    assert out.data_ptr() == view.data_ptr()
    assert torch.equal(pool[10:150:2], codec.decode(enc, with_residual=True, dtype=torch.float16))
    assert pool[11].abs().sum() == 0


def test_registry_accepts_a_whole_lynx_config() -> None:
    import dataclasses

    from sglang_lynx.config import LynxConfig

    cfg = LynxConfig(page_tokens=128, chunk_tokens=16, key_chunk_tokens=16, sink_tokens=2, alpha=1.0)
    codec = get_codec(cfg.codec_name, **dataclasses.asdict(cfg))
    assert codec.name == "lynx" and codec.progressive
    assert codec.params.page_tokens == 128 and codec.params.chunk_tokens == 16 and codec.params.sink_tokens == 2
    assert codec.alpha == 1.0
    assert (
        not get_codec("lynx-int8").progressive
        and get_codec("lynx-int4").encode(outlier_kv(9), "k").residual.numel() == 0
    )
