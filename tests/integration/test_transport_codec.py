"""The transport's request encode/decode (C fast path where it applies) equals the torch reference."""

from __future__ import annotations

import pytest
import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import decode_request_into, encode_request
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.codec import _fast_module, decode_request_streams, encode_request_streams

pytestmark = pytest.mark.timeout(300)


def _layers(tokens: int, layers: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    k = [(torch.randn(tokens, 3, 64, generator=g) * (1 + 20 * (torch.rand(64, generator=g) > 0.95))).bfloat16()
         for _ in range(layers)]
    v = [torch.randn(tokens, 3, 64, generator=g).bfloat16() for _ in range(layers)]
    return k, v


@pytest.mark.parametrize("mode", ["lynx-int8", "lynx-int4", "lynx", "lynx-exact", "int8", "kivi-int4"])
@pytest.mark.parametrize("tokens", [1, 300, 700])
def test_request_streams_equal_reference(mode: str, tokens: int) -> None:
    config = LynxConfig(mode=mode)
    codec = get_codec(config.codec_name, **config.codec_params())
    k, v = _layers(tokens, 3, seed=tokens)
    anchor, residual = encode_request_streams(k, v, codec, config)
    ref = encode_request(k, v, codec)
    assert torch.equal(anchor, ref.anchor) and torch.equal(residual, ref.residual)
    slots = torch.randperm(tokens + 50)[:tokens]
    for with_residual in (False, True):
        if with_residual and not codec.two_streams:
            continue
        pools = [[torch.zeros(tokens + 50, 3, 64, dtype=torch.bfloat16) for _ in range(3)] for _ in range(4)]
        res = residual if with_residual else None
        decode_request_streams(anchor, res, pools[0], pools[1], slots, codec, config)
        decode_request_into((ref.anchor, res), pools[2], pools[3], slots, with_residual=with_residual, codec=codec)
        for got, want in zip(pools[0] + pools[1], pools[2] + pools[3], strict=True):
            assert torch.equal(got, want)


def test_fast_path_is_taken_for_the_lynx_family_on_cpu() -> None:
    config = LynxConfig(mode="lynx-int8")
    codec = get_codec(config.codec_name, **config.codec_params())
    assert _fast_module(codec, config, torch.device("cpu")) is not None
    int8 = LynxConfig(mode="int8")
    assert _fast_module(get_codec("int8", **int8.codec_params()), int8, torch.device("cpu")) is None


def test_lynx_exact_takes_the_lynx_kernels_and_the_exact_c_path_on_cpu() -> None:
    from sglang_lynx.integration.transport.codec import exact_layer_codec, kernel_codec_name

    config = LynxConfig(mode="lynx-exact")
    codec = get_codec(config.codec_name, **config.codec_params())
    assert kernel_codec_name("lynx-exact") == "lynx" and kernel_codec_name("lynx-int8") == "lynx-int8"
    assert _fast_module(codec, config, torch.device("cpu")) is not None  # its anchor and residual are lynx's
    assert exact_layer_codec().__name__ == "sglang_lynx.kernels.lynx_exact_cpu"  # the set-up builds it
