"""Entry point of Lynx's decode-server hooks: :func:`install_decode_hooks` (called from runtime.py).

Lifecycle: called once per SGLang process after the plugin parsed ``--lynx-config``; installs
nothing for the non-progressive modes (they need no decode-side speculation). For mode ``lynx`` it
registers the scheduler hooks of ``decode.scheduler`` (drafting on the anchor-only KV, withholding
drafts, parking, chain verify, fallback, abort); they act only in a PD decode scheduler (the hooked
methods do not run on a prefill server).

Both decode loops are handled (SGLang's default overlap loop and ``--disable-overlap-schedule``; see
``decode.scheduler``, *Batches in flight*). The verify's exactness in bf16 rests on
``decode.verify`` (a decode batch of virtual requests) and ``decode.row_gemm`` (1-row GEMMs); the
latter's hook on SGLang's linear layers is registered here with the scheduler hooks.
"""

from __future__ import annotations

from sglang_lynx.config import LynxConfig


class LynxDecodeNotImplemented(NotImplementedError):
    """A part of progressive (``lynx``) decoding that this build does not have."""


def install_decode_hooks(config: LynxConfig) -> None:
    """Install the decode-server hooks for ``config`` (no-op unless ``config.progressive``)."""
    if not config.progressive:
        return
    from sglang_lynx.integration.decode.scheduler import install_scheduler_hooks

    install_scheduler_hooks(config)
