"""The C fast path is built by the set-up and only loaded at run time; start-up says which path runs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from sglang_lynx.kernels import build as build_cli
from sglang_lynx.kernels import lynx_chain_sdpa, lynx_cpu_fast

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport import codec as transport_codec

pytestmark = pytest.mark.kernels


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kernel cache with nothing in it, and a process that has loaded no library yet."""
    monkeypatch.setenv("LYNX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(lynx_cpu_fast, "_lib", None)
    monkeypatch.setattr(transport_codec, "_SELF_CHECKED", {})
    return tmp_path


def test_run_time_never_compiles(empty_cache: Path) -> None:
    with pytest.raises(lynx_cpu_fast.FastPathNotBuilt, match="python -m sglang_lynx.kernels.build"):
        lynx_cpu_fast.library()
    assert list(empty_cache.iterdir()) == []  # nothing compiled, nothing written


def test_start_up_without_the_library_logs_the_reference(empty_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = LynxConfig()
    codec = get_codec(config.codec_name, **config.codec_params())
    with caplog.at_level(logging.INFO, logger="sglang_lynx.transport"):
        assert transport_codec.prepare_fast_path(codec, config, torch.device("cpu")) == "torch reference"
    assert "not built" in caplog.text and "torch reference" in caplog.text


def test_build_then_start_up_uses_the_fast_path(empty_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert build_cli.main() == 0
    assert lynx_cpu_fast.library_path().parent == empty_cache and lynx_cpu_fast.library_path().exists()
    assert lynx_chain_sdpa.library_path().parent == empty_cache and lynx_chain_sdpa.library_path().exists()
    config = LynxConfig()
    codec = get_codec(config.codec_name, **config.codec_params())
    with caplog.at_level(logging.INFO, logger="sglang_lynx.transport"):
        assert transport_codec.prepare_fast_path(codec, config, torch.device("cpu")) == "C fast path"
    assert "C fast path" in caplog.text
    assert lynx_cpu_fast.build() == lynx_cpu_fast.library_path()  # idempotent: reuses the cached library


def test_missing_compiler_is_a_clear_set_up_message(empty_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-lynx")
    assert build_cli.main() == 1
    err = capsys.readouterr().err
    assert "no C compiler 'no-such-compiler-lynx'" in err and "torch reference" in err
    assert not lynx_cpu_fast.library_path().exists()


def test_a_server_off_the_cpu_takes_the_reference_without_loading_c(empty_cache: Path) -> None:
    config = LynxConfig()
    codec = get_codec(config.codec_name, **config.codec_params())
    assert transport_codec.prepare_fast_path(codec, config, torch.device("meta")) == "torch reference"
