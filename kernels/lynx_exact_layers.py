"""The lynx-exact C fast path over many layers at once (a request's K and V of every layer): the same bytes and
tensors as :func:`lynx_exact_cpu.encode_exact` / :func:`lynx_exact_cpu.decode_exact` called layer by layer.

``threads=N`` here runs N layers at a time, each whole on one thread (its C pass on one worker, its zstd frames
on the same thread): the C calls and zstandard release the GIL, so on N cores the layers' passes, frames and
glue all overlap, where ``threads=N`` on one layer splits only its C pass (and the frames of large layers) and
leaves the rest on one core. With fewer layers than threads, each layer takes the threads itself (as
``lynx_exact_cpu``). Results come back in the order of the layers; the first layer that fails raises its error
(as a loop would), once every layer ran.

Lifecycle: the worker threads are made on first use (one pool per thread count, kept for the process).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from torch import Tensor

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.base import EncodedKV
from sglang_lynx.codec.layout import LayoutParams

from . import lynx_exact_cpu

_Job = TypeVar("_Job")
_Result = TypeVar("_Result")
_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads - 1, "lynx-exact-layers")
        return _pools[threads]


def _each(jobs: Sequence[_Job], threads: int, run: Callable[[_Job, int], _Result]) -> list[_Result]:
    """``[run(job, per_job_threads) for job in jobs]``, ``threads`` jobs at a time when there are that many: the
    calling thread and ``threads - 1`` pooled ones each take the next job not taken until none is left."""
    threads = lynx_exact_cpu._threads(threads)
    if threads == 1 or len(jobs) < threads:
        return [run(job, threads) for job in jobs]
    results: list[Any] = [None] * len(jobs)
    failed: list[BaseException | None] = [None] * len(jobs)
    taken = itertools.count()  # next() on it is atomic under the GIL

    def work() -> None:
        for i in taken:
            if i >= len(jobs):
                return
            try:
                results[i] = run(jobs[i], 1)
            except BaseException as exc:  # noqa: BLE001 - raised below, the first in the order of the layers
                failed[i] = exc

    futures = [_pool(threads).submit(work) for _ in range(threads - 1)]
    work()
    for future in futures:  # every job finished: none is left running on return
        future.result()
    error = next((exc for exc in failed if exc is not None), None)
    if error is not None:
        raise error
    return results


def encode_exact_layers(layers: Sequence[tuple[Tensor, EncodedKV]], params: LayoutParams | None = None, *,
                        level: int = lynx_exact.ZSTD_LEVEL, lib: ctypes.CDLL | None = None, blocks: bool = False,
                        threads: int = 1) -> list[bytes]:  # fmt: skip
    """``[lynx_exact_cpu.encode_exact(x, enc, params, ...) for x, enc in layers]``: the same bytes."""
    lib = lib or lynx_exact_cpu.library()
    return _each(layers, threads, lambda layer, n: lynx_exact_cpu.encode_exact(
        layer[0], layer[1], params, level=level, lib=lib, blocks=blocks, threads=n))  # fmt: skip


def decode_exact_layers(layers: Sequence[tuple[EncodedKV, bytes | bytearray | memoryview]],
                        params: LayoutParams | None = None, *, lib: ctypes.CDLL | None = None, blocks: bool = False,
                        threads: int = 1, out: Sequence[Tensor] | None = None) -> list[Tensor]:  # fmt: skip
    """``[lynx_exact_cpu.decode_exact(enc, exact, params, ...) for enc, exact in layers]``: the same tensors;
    ``out``: one tensor per layer to write it into (as ``decode_exact``'s ``out``)."""
    lib = lib or lynx_exact_cpu.library()
    if out is not None and len(out) != len(layers):
        raise ValueError(f"out holds {len(out)} tensors for {len(layers)} layers")
    jobs = [(*layer, None if out is None else out[i]) for i, layer in enumerate(layers)]
    return _each(jobs, threads, lambda job, n: lynx_exact_cpu.decode_exact(
        job[0], job[1], params, lib=lib, blocks=blocks, threads=n, out=job[2]))  # fmt: skip
