"""``lynx_exact_layers``: many layers at once give the bytes and tensors of one call per layer.

Checked for 1..3 threads (more layers than threads: one layer per thread at a time; fewer: each layer on all of
them): the streams of ``encode_exact_layers`` equal ``lynx_exact_cpu.encode_exact`` per layer, byte for byte,
``decode_exact_layers`` restores every layer bit for bit, and a corrupt layer raises the error a loop would
raise first (layers before and after it valid), with bad arguments refused as by one layer.
"""

from __future__ import annotations

import pytest
import torch
from sglang_lynx.kernels import lynx_exact_cpu, lynx_exact_layers

from sglang_lynx.codec.base import EncodedKV
from sglang_lynx.codec.lynx_exact import ExactStreamError
from sglang_lynx.codec.registry import get_codec

pytestmark = pytest.mark.kernels
PARAMS = {"page_tokens": 64, "key_chunk_tokens": 32, "value_group_size": 32, "sink_tokens": 1}


def _layers(count: int) -> list[tuple[torch.Tensor, EncodedKV]]:
    codec = get_codec("lynx", **PARAMS)
    gen = torch.Generator().manual_seed(count)
    out = []
    for i in range(count):
        tokens = 40 + 37 * i  # partial pages, each layer its own size
        x = torch.randn(tokens, 2, 64, generator=gen) * (torch.rand(2, 64, generator=gen) * 3)
        x[:, 0, 5] += 20.0
        x = x.to(torch.bfloat16)
        out.append((x, codec.encode(x, "k" if i % 2 == 0 else "v")))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("count", [1, 2, 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_layers_give_the_bytes_and_tensors_of_one_call_per_layer(count: int, threads: int) -> None:
    layers = _layers(count)
    params = get_codec("lynx", **PARAMS).params
    want = [lynx_exact_cpu.encode_exact(x, enc, params) for x, enc in layers]
    assert lynx_exact_layers.encode_exact_layers(layers, params, threads=threads) == want
    back = lynx_exact_layers.decode_exact_layers([(enc, s) for (_, enc), s in zip(layers, want, strict=True)], params,
                                                 threads=threads)  # fmt: skip
    assert len(back) == count
    for (x, _), y in zip(layers, back, strict=True):
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_corrupt_layer_raises_what_a_loop_raises_first(threads: int) -> None:
    layers = _layers(6)
    params = get_codec("lynx", **PARAMS).params
    streams = [lynx_exact_cpu.encode_exact(x, enc, params) for x, enc in layers]
    streams[2] = b"LXE0" + streams[2][4:]  # bad magic
    streams[4] = streams[4][:-3]  # truncated
    jobs = [(enc, s) for (_, enc), s in zip(layers, streams, strict=True)]
    with pytest.raises(ExactStreamError) as loop_error:
        for enc, s in jobs:
            lynx_exact_cpu.decode_exact(enc, s, params)
    with pytest.raises(ExactStreamError) as layers_error:
        lynx_exact_layers.decode_exact_layers(jobs, params, threads=threads)
    assert str(layers_error.value) == str(loop_error.value)
    assert "magic" in str(layers_error.value)


def test_bad_thread_counts_are_refused() -> None:
    layers = _layers(2)
    for threads in (0, 99):
        with pytest.raises(ValueError, match="threads must be"):
            lynx_exact_layers.encode_exact_layers(layers, threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_out_tensors_are_written_and_returned(threads: int) -> None:
    layers = _layers(4)
    params = get_codec("lynx", **PARAMS).params
    streams = [lynx_exact_cpu.encode_exact(x, enc, params) for x, enc in layers]
    jobs = [(enc, s) for (_, enc), s in zip(layers, streams, strict=True)]
    out = [torch.full_like(x, 3.0) for x, _ in layers]  # stale values everywhere, sink included
    back = lynx_exact_layers.decode_exact_layers(jobs, params, threads=threads, out=out)
    for (x, _), y, o in zip(layers, back, out, strict=True):
        assert y is o
        assert torch.equal(o.view(torch.int16), x.view(torch.int16))
    with pytest.raises(ValueError, match="out holds 3 tensors for 4 layers"):
        lynx_exact_layers.decode_exact_layers(jobs, params, out=out[:3])


def test_a_wrong_out_tensor_is_refused() -> None:
    (x, enc), = _layers(1)
    params = get_codec("lynx", **PARAMS).params
    stream = lynx_exact_cpu.encode_exact(x, enc, params)
    for bad in (torch.empty_like(x, dtype=torch.float16), torch.empty(x.shape[0] + 1, *x.shape[1:], dtype=x.dtype),
                torch.empty(x.shape[2], x.shape[1], x.shape[0], dtype=x.dtype).transpose(0, 2)):  # fmt: skip
        with pytest.raises(ValueError, match="out must be a contiguous CPU bfloat16 tensor"):
            lynx_exact_cpu.decode_exact(enc, stream, params, out=bad)
