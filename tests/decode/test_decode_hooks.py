"""install_decode_hooks: a no-op for non-progressive modes; for 'lynx' every scheduler hook it
registers is a declared hook target (resolved against the installed SGLang by test_hook_targets)."""

from __future__ import annotations

from sglang_lynx.config import MODES, LynxConfig
from sglang_lynx.integration.decode import scheduler as decode_scheduler
from sglang_lynx.integration.decode.install import install_decode_hooks
from sglang_lynx.integration.hook_targets import TARGETS, resolve
from sglang_lynx.integration.platform.runtime import missing_machinery


def test_non_progressive_modes_install_nothing() -> None:
    for mode in MODES:
        if mode != "lynx":
            install_decode_hooks(LynxConfig(mode=mode))


def test_scheduler_hooks_are_declared_and_resolve() -> None:
    for path, hook, kind in decode_scheduler.SCHEDULER_HOOKS:
        assert path in TARGETS, path
        assert callable(resolve(path)), path
        assert kind in ("before", "after", "around", "replace")
        assert callable(hook)


def test_lynx_mode_is_built() -> None:
    assert missing_machinery(LynxConfig(mode="lynx"), "decode") == ""
