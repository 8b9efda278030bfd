"""The KV shape of a checkpoint, and of the default model, for benchmarks that need sizes without a server.

``DEFAULT_KV`` is SmolLM2-135M-Instruct's (30 layers, 3 KV heads, head dim 64, bf16): the benchmarks
that synthesise KV of the default model's shape use it (``tests/benchmarks/test_model_shape.py``
checks it against the prepared checkpoint's ``config.json``); ``kv_shape(model_dir)`` reads any
checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


DEFAULT_KV = KVShape(layers=30, kv_heads=3, head_dim=64)


def kv_shape(model_dir: str | Path) -> KVShape:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return KVShape(int(cfg["num_hidden_layers"]), int(kv_heads), int(head_dim))
