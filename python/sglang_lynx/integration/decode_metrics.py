"""Aggregate counters of progressive decoding, on SGLang's Prometheus ``/metrics``.

Lifecycle: :func:`count` is called by the decode-scheduler hooks in the scheduler process; the first
call creates ``prometheus_client`` counters (``sglang_lynx_<name>_total``) in the default registry,
which SGLang's ``/metrics`` endpoint exposes when the server runs with ``--enable-metrics`` (SGLang
uses prometheus_client's multiprocess mode, so counters made in the scheduler process are
collected). Without prometheus_client the counters live only in :data:`COUNTS` (also attached to
each finished request's ``meta_info['lynx_server_counts']``).
"""

from __future__ import annotations

from typing import Any

NAMES = {
    "requests": "Lynx requests admitted on their anchor",
    "drafts": "draft tokens decoded on anchor-only KV and verified",
    "accepted": "draft tokens accepted by verification",
    "verifies": "chain verification passes (including recompute fallbacks)",
    "fallbacks": "requests whose residual failed or was late and took the recompute policy",
    "failed": "requests failed by the 'fail' policy",
}
COUNTS: dict[str, int] = dict.fromkeys(NAMES, 0)
_COUNTERS: dict[str, Any] = {}


def _counter(name: str) -> Any:
    if name not in _COUNTERS:
        try:
            from prometheus_client import Counter
        except ImportError:  # pragma: no cover - prometheus_client ships with sglang
            _COUNTERS[name] = None
        else:
            try:
                _COUNTERS[name] = Counter(f"sglang_lynx_{name}", NAMES[name])
            except ValueError:  # already registered (module reloaded in one process)
                _COUNTERS[name] = None
    return _COUNTERS[name]


def count(name: str, value: int = 1) -> None:
    """Add ``value`` to counter ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise KeyError(f"unknown Lynx counter {name!r}; known: {', '.join(NAMES)}")
    COUNTS[name] += value
    counter = _counter(name)
    if counter is not None and value:
        counter.inc(value)
