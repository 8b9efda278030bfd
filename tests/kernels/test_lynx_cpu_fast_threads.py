"""The C fast path split over threads: the same bytes and pool values as one thread and as the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import outlier_kv
from sglang_lynx.kernels import lynx_cpu_fast as fast
from sglang_lynx.kernels import lynx_cpu_threads

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.registry import get_codec

PARAMS = [
    LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8,
                 value_group_size=16, sink_tokens=2, recent_tokens=40),
    LayoutParams(),  # defaults: 256-token pages, key chunks and value groups of 64, trailer of 48 tokens
    LayoutParams(page_tokens=16, chunk_tokens=4, key_chunk_tokens=4, value_group_size=64, sink_tokens=0,
                 recent_tokens=0),
]
# (tokens, heads, dim, dtype): every case has a partial last page
CASES = [
    (301, 3, 64, torch.bfloat16),
    (77, 2, 32, torch.float16),
    (529, 1, 64, torch.float32),
    (1000, 2, 64, torch.bfloat16),
]


@pytest.fixture
def always_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split even small layers, so that these inputs take the threaded path."""
    monkeypatch.setattr(lynx_cpu_threads, "MIN_PARALLEL_VALUES", 0)


def _input(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = outlier_kv(tokens, heads, dim, seed=seed)  # an outlier channel and spikes
    x[0] += 50.0  # a sink far outside its chunk's range
    x[40:50] = -2.5  # constant chunks / groups
    x[-3:, 0, :8] = 0.0  # zeros in the last (partial) page
    return x.to(dtype)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("always_parallel")
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("params", PARAMS, ids=["small", "default", "no-sink-no-trailer"])
@pytest.mark.parametrize(("tokens", "heads", "dim", "dtype"), CASES)
def test_threads_identical_to_one_thread_and_reference(kind, params, tokens, heads, dim, dtype) -> None:
    x = _input(tokens, heads, dim, dtype, seed=tokens)
    codec = get_codec("lynx", **vars(params))
    ref = codec.encode(x, kind)
    slots = torch.randperm(tokens + 7, generator=torch.Generator().manual_seed(tokens))[:tokens]
    for threads in (1, 2, 3):
        got = fast.encode(x, kind, params=params, threads=threads)
        assert torch.equal(got.anchor, ref.anchor), f"threads={threads}: anchor bytes differ"
        assert torch.equal(got.residual, ref.residual), f"threads={threads}: residual bytes differ"
        for pool_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for with_residual in (False, True):
                want = codec.decode(ref, with_residual=with_residual, dtype=pool_dtype)
                pool = torch.full((tokens + 7, heads, dim), 7.0, dtype=pool_dtype)
                residual = ref.residual if with_residual else None
                fast.decode_into(ref.anchor, residual, pool, slots, kind=kind, params=params, threads=threads)
                assert torch.equal(pool[slots], want), f"threads={threads} {pool_dtype} residual={with_residual}"
                untouched = torch.ones(tokens + 7, dtype=torch.bool)
                untouched[slots] = False
                assert bool((pool[untouched] == 7.0).all())


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("always_parallel")
def test_threaded_errors_match_one_thread() -> None:
    params = LayoutParams(page_tokens=32, chunk_tokens=8, key_chunk_tokens=8)
    x = outlier_kv(300, 3, 64, seed=5)
    bad = x.clone()
    bad[290, 1, 1] = float("nan")  # in the last range
    big = x.clone()
    big[200, 0, 0] = 50000.0
    for threads in (1, 2, 4):
        with pytest.raises(ValueError, match=r"layer 3 v: NaN or Inf in page 9"):
            fast.encode(bad, "v", params=params, layer=3, threads=threads)
        with pytest.raises(ValueError, match=r"page 6: \|value\| up to 50000"):
            fast.encode(big, "k", params=params, threads=threads)
        enc = fast.encode(x, "k", params=params, threads=threads)
        pool = torch.zeros(300, 3, 64)
        with pytest.raises(IndexError):
            fast.decode_into(enc.anchor, None, pool, torch.arange(300) + 1, kind="k", params=params, threads=threads)
        assert bool((pool == 0).all()), "nothing is written when a slot is out of range"


def test_default_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast.THREADS_ENV, raising=False)
    assert fast.default_threads() == 1  # single-threaded unless asked
    monkeypatch.setenv(fast.THREADS_ENV, "1")
    assert fast.default_threads() == 1
    monkeypatch.setenv(fast.THREADS_ENV, "3")
    assert fast.default_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(fast.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=fast.THREADS_ENV):
            fast.default_threads()
