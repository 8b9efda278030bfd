"""Page ranges of one layer run on a few threads, for the C fast path (``lynx_cpu_fast``, ``lynx_cpu_pages``).

Threads: pages are independent, so one layer's pages can be split into contiguous ranges run at once
(the C calls release the GIL; the calling thread runs the first range, a shared pool the others), with
``$LYNX_CPU_THREADS`` or the ``threads=`` argument; layers under ``MIN_PARALLEL_VALUES`` values stay on
one thread (the hand-off costs more than it saves). The default is ONE thread (the calling thread only):
one thread already meets the throughput targets, and on the shared 2-core development VM, whose other
core is busy with other work, two threads measured slower than one (benchmark/kernels/RESULTS.md); in a
deployment the codec shares the CPU with SGLang's own threads. Opt in where cores are idle. The output
does not depend on the thread count (given distinct slot indices: with a repeated slot, as with
``index_copy_``, which token lands is unspecified).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

THREADS_ENV = "LYNX_CPU_THREADS"
MIN_PARALLEL_VALUES = 1 << 17  # values (tokens * heads * head_dim) of a layer below which it runs on one thread

_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, executor)


def default_threads() -> int:
    """Threads per layer: ``$LYNX_CPU_THREADS`` if set, else 1 (see the module docstring)."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{THREADS_ENV}: expected a positive integer, got {env!r}")
        return int(env)
    return 1


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool (at least ``workers`` threads; a fresh one after a fork, whose child has no threads)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            if _pool is not None and _pool[0] == os.getpid():
                _pool[2].shutdown(wait=False)
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="lynx-cpu"))
        return _pool[2]


def run_pages(fn: Callable[[int, int], int | None], pages: int, values: int, threads: int | None) -> list:
    """``fn(p0, p1)`` over pages [0, pages), split into contiguous ranges on up to ``threads`` threads."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected a positive integer or None, got {threads!r}")
    n = min(threads or default_threads(), pages) if values >= MIN_PARALLEL_VALUES else 1
    if n <= 1:
        return [fn(0, pages)]
    bounds = [pages * i // n for i in range(n + 1)]
    pool = _executor(n - 1)
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, n)]
    first = fn(bounds[0], bounds[1])
    return [first, *(f.result() for f in futures)]
