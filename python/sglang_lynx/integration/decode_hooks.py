"""Entry point of Lynx's decode-server hooks: :func:`install_decode_hooks` (called from plugin.py).

State of this module (honest): the pieces the scheduler hooks would drive exist and are tested —
the accept/reject math (``sglang_lynx.decode.speculative``), the per-request state machine and
decision function (``sglang_lynx.decode.state``), and the chain verify forward on SGLang's model
runner (``integration.decode_verify``). The scheduler hooks themselves (admission on anchor via
``DecodeTransferQueue.pop_transferred``, withholding drafts from the output streamer, undoing finish
inside the draft window, parking / verifying / re-admitting requests, abort of parked requests,
meta_info and Prometheus counters) are NOT implemented yet. Progressive mode therefore refuses to
start instead of silently decoding without speculation.

Lifecycle: called once per SGLang process after the plugin parsed ``--lynx-config``; installs
nothing for the non-progressive modes (they need no decode-side speculation).
"""

from __future__ import annotations

from sglang_lynx.config import LynxConfig


class LynxDecodeNotImplemented(NotImplementedError):
    """Progressive (``lynx``) decoding was requested but its scheduler hooks do not exist yet."""


MISSING_PIECES = (
    "admission on anchor (AROUND DecodeTransferQueue.pop_transferred)",
    "withholding drafts from the streamer and undoing finish inside the draft window",
    "parking, chain verify and re-admission of requests in the scheduler loop",
    "abort / idle handling of parked requests",
    "meta_info fields and Prometheus counters",
)


def install_decode_hooks(config: LynxConfig) -> None:
    """Install the decode-server hooks for ``config`` (no-op unless ``config.progressive``)."""
    if not config.progressive:
        return
    raise LynxDecodeNotImplemented(
        "sglang-lynx: mode 'lynx' (progressive speculative decoding) is not implemented in the "
        "decode scheduler yet; missing: " + "; ".join(MISSING_PIECES) + ". Use mode 'lynx-int8' "
        "(same KV, no speculation) until it lands."
    )
