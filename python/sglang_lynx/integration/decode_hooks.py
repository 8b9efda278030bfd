"""Entry point of Lynx's decode-server hooks: :func:`install_decode_hooks` (called from runtime.py).

Lifecycle: called once per SGLang process after the plugin parsed ``--lynx-config``; installs
nothing for the non-progressive modes (they need no decode-side speculation). For mode ``lynx`` it
registers the scheduler hooks of ``decode_scheduler`` (drafting on the anchor-only KV, withholding
drafts, parking, chain verify, fallback, abort); they act only in a PD decode scheduler (the hooked
methods do not run on a prefill server).

What is not built (and how it shows): the overlap scheduler is refused at start-up with a clear
error (use ``--disable-overlap-schedule`` on the decode server); requests with temperature > 0 do
not draft (speculative sampling is not wired into the scheduler: they wait for the residual and are
marked in ``meta_info['lynx_fallback']``). Aggregate counters (``decode_metrics``) are registered
with prometheus_client in the scheduler process; their presence on a live ``/metrics`` page has not
been checked by a test yet.
"""

from __future__ import annotations

from sglang_lynx.config import LynxConfig


class LynxDecodeNotImplemented(NotImplementedError):
    """A part of progressive (``lynx``) decoding that this build does not have."""


def install_decode_hooks(config: LynxConfig) -> None:
    """Install the decode-server hooks for ``config`` (no-op unless ``config.progressive``)."""
    if not config.progressive:
        return
    from sglang_lynx.integration.decode_scheduler import install_scheduler_hooks

    install_scheduler_hooks(config)
