"""The default model's KV shape that benchmarks synthesise KV from is the prepared checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark.model_shape import DEFAULT_KV, KVShape, kv_shape


def test_default_shape_is_the_prepared_checkpoints(model_path: str) -> None:
    assert kv_shape(model_path) == DEFAULT_KV
    assert DEFAULT_KV.bytes_per_token == 23_040


def test_shape_from_a_config_without_head_dim(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2}))
    assert kv_shape(tmp_path) == KVShape(layers=4, kv_heads=2, head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 256,
                                                      "num_attention_heads": 4, "head_dim": 32}))
    assert kv_shape(tmp_path).bytes_per_token == 2 * 2 * 4 * 32 * 2
