"""Property tests (hypothesis): shapes, page/chunk/group sizes, heavy-outlier value distributions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_lynx.codec.layout import stream_bytes
from sglang_lynx.codec.registry import get_codec


@st.composite
def kv_cases(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, int]]:
    tokens = draw(st.integers(1, 300))
    heads = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([16, 32, 64]))
    page = draw(st.sampled_from([16, 64, 256]))
    chunk = draw(st.sampled_from([c for c in (4, 8, 16, 32) if c <= page]))
    params = {
        "page_tokens": page,
        "chunk_tokens": chunk,
        "key_chunk_tokens": chunk,
        "group_size": draw(st.sampled_from([8, 16, 32, 64])),
        "value_group_size": draw(st.sampled_from([8, 16, 32, 64])),
        "sink_tokens": draw(st.integers(0, min(4, page))),
    }
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(tokens, heads, dim, generator=gen) * torch.rand(heads, dim, generator=gen).mul(
        draw(st.floats(0.01, 50))
    )
    x += torch.randn(heads, dim, generator=gen) * draw(st.floats(0, 100))
    spikes = draw(st.integers(0, 20))
    if spikes:
        idx = torch.randint(0, x.numel(), (spikes,), generator=gen)
        x.view(-1)[idx] = (torch.rand(spikes, generator=gen) - 0.5) * draw(st.floats(1, 2e4))
    return x.to(torch.bfloat16), params


def group_ranges(x: torch.Tensor, grouping: str, chunk: int, group: int) -> torch.Tensor:
    """Per-element range (max - min) of the element's group, chunks counted from token 0."""
    t, h, d = x.shape
    if grouping == "token":
        g = x.view(t, h, d // group, group)
        return (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)).expand_as(g).reshape(t, h, d)
    out = torch.empty_like(x)
    for start in range(0, t, chunk):
        block = x[start : start + chunk]
        out[start : start + chunk] = block.amax(0) - block.amin(0)
    return out


@settings(max_examples=40, deadline=None)
@given(kv_cases(), st.sampled_from(["k", "v"]))
def test_lynx_error_within_documented_step(case: tuple[torch.Tensor, dict[str, int]], kind: str) -> None:
    x, params = case
    codec = get_codec("lynx", **params)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    assert (enc.anchor.numel(), enc.residual.numel()) == stream_bytes(
        "lynx",
        *x.shape,
        kind,
        codec.params,  # type: ignore[arg-type]
    )
    xf = x.float()
    grouping = "channel" if kind == "k" else "token"
    group = min(params["value_group_size"], x.shape[2])
    rng = group_ranges(xf, grouping, params["chunk_tokens"], group)
    slack = xf.abs().amax() * 2.0**-9 + 1e-6  # fp16 rounding of the group min and range
    for with_residual, levels in ((False, 15), (True, 225)):
        y = codec.decode(enc, with_residual=with_residual, dtype=torch.float32)
        err = (y - xf).abs()
        bound = (rng + slack) / (2 * levels) * 1.001 + 1e-6
        bad = err > bound
        assert not bad.any(), (with_residual, float((err - bound).max()))
        sink = min(params["sink_tokens"], x.shape[0])
        assert torch.equal(y[:sink], xf[:sink])


@settings(max_examples=25, deadline=None)
@given(kv_cases(), st.sampled_from(["int8", "int4", "kivi-int4", "kivi-int2", "lynx-paper", "bf16"]))
def test_every_codec_round_trips_bytes_and_bounds(case: tuple[torch.Tensor, dict[str, int]], name: str) -> None:
    x, params = case
    codec = get_codec(name, **params)
    for kind in ("k", "v"):
        enc = codec.encode(x, kind)  # type: ignore[arg-type]
        y = codec.decode(enc, with_residual=True, dtype=torch.float32)
        again = codec.decode_from_bytes(
            bytes(enc.anchor.numpy()),
            bytes(enc.residual.numpy()),
            *x.shape,
            kind,  # type: ignore[arg-type]
            dtype=torch.float32,
        )
        assert torch.equal(y, again)
        assert torch.isfinite(y).all()
        # no codec may push a value outside the input's overall range (plus fp16 metadata slack)
        span = float(x.float().amax() - x.float().amin())
        slack = float(x.float().abs().amax()) * 2.0**-8 + 1e-5 + span * 1e-3
        assert float(y.amax()) <= float(x.float().amax()) + slack
        assert float(y.amin()) >= float(x.float().amin()) - slack
