"""install_decode_hooks: a no-op for non-progressive modes, a clear refusal for 'lynx' (not built)."""

from __future__ import annotations

import pytest

from sglang_lynx.config import MODES, LynxConfig
from sglang_lynx.integration.decode_hooks import LynxDecodeNotImplemented, install_decode_hooks


def test_non_progressive_modes_install_nothing() -> None:
    for mode in MODES:
        if mode != "lynx":
            install_decode_hooks(LynxConfig(mode=mode))


def test_progressive_mode_refuses_with_a_clear_error() -> None:
    with pytest.raises(LynxDecodeNotImplemented, match="not implemented.*lynx-int8"):
        install_decode_hooks(LynxConfig(mode="lynx"))
