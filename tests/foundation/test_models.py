"""Preparing the embedded default model: idempotent, and damaged files are detected."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from sglang_lynx.models.catalog import get_spec, model_dir
from sglang_lynx.models.prepare import (
    MANIFEST,
    ModelPrepareError,
    check_checkpoint,
    locate_gguf,
    prepare,
    verify_gguf,
)


def test_prepared_checkpoint_is_complete(model_path: str) -> None:
    directory = Path(model_path)
    assert check_checkpoint(directory) == []
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= names
    assert (directory / "chat_template.jinja").exists() or "chat_template" in (
        directory / "tokenizer_config.json").read_text()


def test_prepare_twice_does_not_rebuild(model_path: str) -> None:
    manifest = Path(model_path) / MANIFEST
    before = manifest.stat().st_mtime_ns
    started = time.monotonic()
    assert str(prepare("smollm2-135m")) == model_path
    assert time.monotonic() - started < 30
    assert manifest.stat().st_mtime_ns == before


def test_truncated_gguf_is_detected(tmp_path: Path) -> None:
    spec = get_spec("smollm2-135m")
    source = locate_gguf(spec)
    damaged = tmp_path / spec.gguf_file
    with source.open("rb") as src, damaged.open("wb") as dst:
        dst.write(src.read(source.stat().st_size // 2))
    with pytest.raises(ModelPrepareError, match="corrupted or truncated"):
        verify_gguf(spec, damaged)


@pytest.mark.timeout(900)
def test_truncated_checkpoint_is_detected_and_rebuilt(model_path: str, tmp_path: Path) -> None:
    copy = model_dir("smollm2-135m", tmp_path)
    shutil.copytree(model_path, copy)
    weights = copy / "model.safetensors"
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size - 4096)
    problems = check_checkpoint(copy)
    assert problems and "truncated" in problems[0]
    rebuilt = prepare("smollm2-135m", root=tmp_path)
    assert rebuilt == copy and check_checkpoint(rebuilt) == []


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        get_spec("llama-70b")
