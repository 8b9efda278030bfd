"""Every hook target and attribute we rely on exists in the installed (pinned) SGLang."""

from __future__ import annotations

import importlib.metadata

import pytest

from sglang_lynx.integration.hook_targets import ATTRIBUTES, TARGETS, VERIFY_ATTENTION_BACKENDS, register, resolve


def test_pinned_sglang_version() -> None:
    assert importlib.metadata.version("sglang") == "0.5.23"


@pytest.mark.parametrize("path", sorted(TARGETS))
def test_hook_target_resolves(path: str) -> None:
    assert callable(resolve(path)), f"{path} is not callable in the installed SGLang"


@pytest.mark.parametrize("path", [b.path for b in VERIFY_ATTENTION_BACKENDS])
def test_verify_backend_class_resolves(path: str) -> None:
    assert isinstance(resolve(path), type)


@pytest.mark.parametrize("path", [a.path for a in ATTRIBUTES])
def test_attribute_resolves(path: str) -> None:
    resolve(path)


def test_undeclared_target_is_refused() -> None:
    with pytest.raises(KeyError, match="not a declared hook target"):
        register("sglang.srt.managers.scheduler.Scheduler.no_such_method", lambda *a: None, "after")


def test_plugin_entry_point_is_installed() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert names.get("lynx") == "sglang_lynx.integration.plugin:load_plugin"
