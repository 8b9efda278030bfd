"""The C fast path and the Triton kernels (interpreted) with ``lynx``'s layer trailer (``recent_tokens``)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels import lynx_cpu_fast

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

PARAMS = [
    LayoutParams(page_tokens=32, chunk_tokens=8, value_group_size=16, sink_tokens=2, recent_tokens=40),
    LayoutParams(recent_tokens=48),
]


def _check(module, x: torch.Tensor, kind: str, params: LayoutParams, name: str) -> None:  # noqa: ANN001
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


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
@pytest.mark.parametrize("tokens", [300, 30])
def test_cpu_fast_path_matches_the_reference_with_a_trailer(params, kind, name, tokens) -> None:
    _check(lynx_cpu_fast, outlier_kv(tokens, 3, 64, seed=tokens).to(torch.bfloat16), kind, params, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
def test_triton_matches_the_reference_with_a_trailer(lynx_triton, kind, name) -> None:
    _check(lynx_triton, outlier_kv(70, 2, 64, seed=4).to(torch.bfloat16), kind, PARAMS[0], name)
