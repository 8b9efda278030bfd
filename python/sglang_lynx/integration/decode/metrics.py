"""Aggregate counters of progressive decoding, on SGLang's Prometheus ``/metrics``.

Lifecycle: each decode server's state (``decode.state.DecodeLynxState``) owns one
:class:`ServerCounts`; the decode-scheduler hooks call its :meth:`~ServerCounts.count`, which adds to
that server's own totals (attached to each finished request's ``meta_info['lynx_server_counts']``)
and to the process's ``prometheus_client`` counters (``sglang_lynx_<name>_total``, made on first
use in the default registry), which SGLang's ``/metrics`` endpoint exposes when the server runs
with ``--enable-metrics`` (SGLang uses prometheus_client's multiprocess mode, so counters made in
the scheduler process are collected).

The prometheus counters are module-level on purpose: prometheus_client's default registry is one
per process and refuses a second counter of the same name, so :data:`_COUNTERS` only caches the
registered counter objects (one SGLang scheduler per process in a deployment).
"""

from __future__ import annotations

from typing import Any

NAMES = {
    "requests": "Lynx requests admitted on their anchor",
    "drafts": "draft tokens decoded on anchor-only KV and verified",
    "accepted": "draft tokens accepted by verification",
    "bonus": "tokens released by verification after a fully accepted draft window (the token after the last draft)",
    "verifies": "chain verification passes (including recompute fallbacks)",
    "fallbacks": "requests whose residual failed or was late and took the recompute policy",
    "failed": "requests failed by the 'fail' policy",
    "residual_upgrades": "lynx-exact requests that drafted on from the 8-bit KV before their exact stream landed",
}
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


class ServerCounts:
    """One decode server's totals of the counters in :data:`NAMES`."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(NAMES, 0)

    def count(self, name: str, value: int = 1) -> None:
        """Add ``value`` to counter ``name`` (one of :data:`NAMES`), here and in prometheus."""
        if name not in NAMES:
            raise KeyError(f"unknown Lynx counter {name!r}; known: {', '.join(NAMES)}")
        self.counts[name] += value
        counter = _counter(name)
        if counter is not None and value:
            counter.inc(value)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
