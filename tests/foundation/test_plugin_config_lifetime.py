"""The published Lynx config (``SGLANG_LYNX_CONFIG``) has an explicit lifetime in the launcher:
withdrawn once the server's processes are started, and by an argument parse without ``--lynx``
(so a second server in one process never inherits an earlier one's config)."""

from __future__ import annotations

import argparse
import os

import pytest

from sglang_lynx.config import LYNX_CONFIG_ENV, LynxConfig
from sglang_lynx.integration import plugin
from sglang_lynx.integration.hook_targets import TARGETS


def test_the_launcher_withdraws_the_config_once_its_processes_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LYNX_CONFIG_ENV, raising=False)
    LynxConfig(mode="lynx").publish()
    assert LynxConfig.from_env() == LynxConfig(mode="lynx")
    assert plugin._after_launch_subprocesses(("tokenizer manager", "...")) is None  # the result stands
    assert LYNX_CONFIG_ENV not in os.environ and LynxConfig.from_env() is None
    assert "sglang.srt.entrypoints.engine.Engine._launch_subprocesses" in TARGETS


def test_a_parse_without_lynx_withdraws_an_earlier_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LYNX_CONFIG_ENV, raising=False)
    LynxConfig(mode="lynx-int8").publish()
    plugin._after_from_cli_args(object(), None, argparse.Namespace(lynx=False, lynx_config=None))
    assert LYNX_CONFIG_ENV not in os.environ
