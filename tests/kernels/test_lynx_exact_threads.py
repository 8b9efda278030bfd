"""The lynx-exact C path with several workers (``threads=``): the bytes and tensors of one worker.

Encode splits a layer's rows into consecutive runs (one per worker) and joins their ranks and escapes;
decode hands chunks of rows round-robin to the workers, each expanding its chunk once the chunk before
says where its ranks end. Checked: the same exact stream and the same BF16 tensor for 1..4 workers (both
builds) on layers of many decode chunks with sinks, partial pages and escapes, and the same outcome (error
message or tensor) on corrupt streams.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_lynx.kernels import lynx_exact_cpu

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.lynx_exact import ExactStreamError, encode_exact
from sglang_lynx.codec.registry import get_codec

pytestmark = pytest.mark.kernels


@functools.cache
def libraries() -> tuple[ctypes.CDLL, ...]:
    """The default build, the scalar one, and where the CPU has AVX-512 VBMI2, the AVX-512 build without it
    (16-bit compress / expand by 32-bit halves, as on older AVX-512 CPUs)."""
    with open("/proc/cpuinfo") as info:
        vbmi2 = " avx512_vbmi2 " in f" {next((line for line in info if line.startswith('flags')), '')} "
    variants = [("-DLYNX_EXACT_SCALAR",), *([("-mno-avx512vbmi2",)] if vbmi2 else [])]
    return (lynx_exact_cpu.library(), *(lynx_exact_cpu.load(lynx_exact_cpu.build(v)) for v in variants))


@st.composite
def layers(draw: st.DrawFn) -> tuple[torch.Tensor, dict[str, int]]:
    tokens, heads = draw(st.integers(1, 700)), draw(st.integers(1, 3))
    page = draw(st.sampled_from([16, 64, 256]))
    chunk = draw(st.sampled_from([c for c in (4, 32, 64) if c <= page]))
    params = {"page_tokens": page, "chunk_tokens": 8, "key_chunk_tokens": chunk,
              "value_group_size": draw(st.sampled_from([16, 64])), "sink_tokens": draw(st.integers(0, 3))}
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(tokens, heads, 64, generator=gen) * (torch.rand(heads, 64, generator=gen) * 3)
    x[:, 0, 5] += 20.0
    return x.to(torch.bfloat16), params


@settings(max_examples=30, deadline=None)
@given(layers(), st.sampled_from(["k", "v"]))
def test_workers_give_the_bytes_and_values_of_one(case: tuple[torch.Tensor, dict[str, int]], kind: str) -> None:
    x, params = case
    codec = get_codec("lynx", **params)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    want = encode_exact(x, enc, codec.params)
    for lib in libraries():
        for threads in (1, 2, 3, 4):
            assert lynx_exact_cpu.encode_exact(x, enc, codec.params, lib=lib, threads=threads) == want, threads
            back = lynx_exact_cpu.decode_exact(enc, want, codec.params, lib=lib, threads=threads)
            assert torch.equal(back.view(torch.int16), x.view(torch.int16)), threads


def test_many_chunks_with_escapes() -> None:
    """2,000 tokens of keys (31 decode chunks of 64 rows), values escaped in several chunks."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2000, 3, 64, generator=gen) * 2).to(torch.bfloat16)
    codec = get_codec("lynx", sink_tokens=0)
    enc = codec.encode(x, "k")
    bad = x.clone()
    for t in (3, 700, 1333, 1999):
        bad[t, 1, 2] = -3000.0  # outside its group's range: an escape
    want = encode_exact(bad, enc, codec.params)
    assert int.from_bytes(want[4:8], "little") >= 4
    assert lynx_exact_cpu.library().lynx_exact_decode_chunk_rows(192, 64) * 4 < 2000
    for threads in (1, 2, 4):
        assert lynx_exact_cpu.encode_exact(bad, enc, codec.params, threads=threads) == want
        back = lynx_exact_cpu.decode_exact(enc, want, codec.params, threads=threads)
        assert torch.equal(back.view(torch.int16), bad.view(torch.int16))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.sampled_from(["k", "v"]))
def test_corrupt_streams_fail_alike_with_workers(seed: int, flips: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(600, 3, 64, generator=gen) * 3).to(torch.bfloat16)
    codec = get_codec("lynx", page_tokens=64, key_chunk_tokens=32)
    enc = codec.encode(x, kind)  # type: ignore[arg-type]
    data = bytearray(encode_exact(x, enc, codec.params))
    for at in torch.randint(0, len(data), (flips,), generator=gen).tolist():
        data[at] ^= int(torch.randint(1, 256, (1,), generator=gen))
    outcomes = []
    for threads in (1, 2, 3):
        try:
            outcomes.append(lynx_exact_cpu.decode_exact(enc, bytes(data), codec.params, threads=threads))
        except ExactStreamError as exc:
            outcomes.append(str(exc))
    for other in outcomes[1:]:
        if isinstance(outcomes[0], str):
            assert other == outcomes[0]
        else:
            assert isinstance(other, torch.Tensor) and isinstance(outcomes[0], torch.Tensor)
            assert torch.equal(other.view(torch.int16), outcomes[0].view(torch.int16))


@functools.cache
def large_stream() -> tuple[bytes, int]:
    """A layer whose frames hold more than lynx_exact.PARALLEL_MIN_BYTES (so workers split them)."""
    x = (torch.randn(2000, 3, 64, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    codec = get_codec("lynx")
    return encode_exact(x, codec.encode(x, "v"), codec.params), x.numel()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 6))
def test_frames_on_workers_are_those_of_one(seed: int, flips: int) -> None:
    """Corrupt frames (flips past the header and escapes): parse_stream with 2 or 3 workers raises the message
    one worker raises (the first bad frame in order), or returns the same planes."""
    stream, values = large_stream()
    _, escapes, *frame_bytes = lynx_exact.HEADER.unpack_from(stream)
    assert sum(frame_bytes) > lynx_exact.PARALLEL_MIN_BYTES
    start = lynx_exact.HEADER.size + 6 * escapes
    gen = torch.Generator().manual_seed(seed)
    data = bytearray(stream)
    for at in torch.randint(start, len(data), (flips,), generator=gen).tolist():
        data[at] ^= int(torch.randint(1, 256, (1,), generator=gen))
    outcomes: list[object] = []
    for workers in (1, 2, 3):
        try:
            outcomes.append(lynx_exact.parse_stream(bytes(data), values, workers=workers))
        except ExactStreamError as exc:
            outcomes.append(str(exc))
    assert outcomes[1] == outcomes[0] and outcomes[2] == outcomes[0]


def test_threads_are_checked() -> None:
    x = torch.randn(8, 1, 64).to(torch.bfloat16)
    codec = get_codec("lynx")
    enc = codec.encode(x, "v")
    for bad in (0, 9, 1.5):
        with pytest.raises(ValueError, match="threads"):
            lynx_exact_cpu.encode_exact(x, enc, codec.params, threads=bad)  # type: ignore[arg-type]
