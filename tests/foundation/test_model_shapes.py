"""The small random checkpoints of other shapes (``sglang_lynx.models.shapes``): what they hold, that
the start-up check lets them through (and refuses a sliding-window variant), that building is
idempotent, and the ``build-shape`` command line. No server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_lynx.integration.platform.deployment_check import model_refusals
from sglang_lynx.models.__main__ import main
from sglang_lynx.models.catalog import SHAPES, model_dir

EXPECTED_TYPES = {"llama3-shape": "llama", "qwen3-shape": "qwen3", "mistral-shape": "mistral"}


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    from sglang_lynx.models.shapes import build_shape

    return {name: build_shape(name) for name in SHAPES}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_checkpoint_has_the_serving_attention_shape(built: dict[str, Path], name: str) -> None:
    from safetensors import safe_open

    config = json.loads((built[name] / "config.json").read_text())
    assert config["model_type"] == EXPECTED_TYPES[name]
    assert (config["num_key_value_heads"], config["head_dim"], config["num_attention_heads"]) == (8, 128, 16)
    assert config["vocab_size"] == 49152 and (built[name] / "tokenizer.json").is_file()
    with safe_open(str(built[name] / "model.safetensors"), "pt") as weights:
        keys = list(weights.keys())
    has_qk_norm = any("q_norm" in k for k in keys) and any("k_norm" in k for k in keys)
    assert has_qk_norm == (name == "qwen3-shape"), keys[:20]
    assert model_refusals(config) == [], config  # full attention only: the start-up check lets it through


def test_a_mistral_shape_with_a_sliding_window_is_refused(built: dict[str, Path]) -> None:
    config = json.loads((built["mistral-shape"] / "config.json").read_text())
    assert config["sliding_window"] is None
    refusals = model_refusals({**config, "sliding_window": 4096})
    assert len(refusals) == 1 and "sliding_window 4096" in refusals[0], refusals


def test_building_again_is_idempotent(built: dict[str, Path]) -> None:
    from sglang_lynx.models.shapes import build_shape

    weights = built["qwen3-shape"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_shape("qwen3-shape") == built["qwen3-shape"]
    assert weights.stat().st_mtime_ns == before  # not rebuilt


def test_build_shape_command_line(built: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build-shape", "mistral"]) == 0
    assert capsys.readouterr().out.strip() == str(built["mistral-shape"])
    assert main(["path", "llama3-shape"]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir("llama3-shape"))
    assert main(["build-shape", "smollm2-135m"]) == 2
    assert "not a shape" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["path", "qwen3"])  # the short names are for build-shape only
