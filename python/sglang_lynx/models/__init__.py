"""The embedded default model and how to prepare it offline (see ``prepare``)."""

from sglang_lynx.models.catalog import DEFAULT_MODEL, MODELS, ModelSpec, cache_root, get_spec, model_dir

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "cache_root", "get_spec", "model_dir"]
