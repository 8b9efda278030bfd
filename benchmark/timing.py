"""Wall-clock timing shared by the micro-benchmarks: one warm-up call, then the median of ``repeats`` calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """``fn()`` once to warm up, then the median wall-clock seconds of ``repeats`` more calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
