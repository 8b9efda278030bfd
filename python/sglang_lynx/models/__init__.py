"""The embedded default model and how to prepare it offline (see ``prepare``), and the small random
checkpoints of other shapes built from a config (see ``shapes``)."""

from sglang_lynx.models.catalog import (
    DEFAULT_MODEL,
    MODELS,
    SHAPES,
    ModelSpec,
    ShapeSpec,
    cache_root,
    get_shape,
    get_spec,
    model_dir,
)

__all__ = ["DEFAULT_MODEL", "MODELS", "SHAPES", "ModelSpec", "ShapeSpec", "cache_root", "get_shape", "get_spec",
           "model_dir"]
