"""Small randomly initialised checkpoints of other model shapes, built locally from a config.

The default model is one Llama-shaped checkpoint with 3 KV heads of head_dim 64. Serving teams run
Llama-3, Qwen3 and Mistral shapes (8 KV heads, head_dim 128, Qwen3's q/k norms); the shapes here
have those attention shapes with a few layers and random weights, so that the byte-equality and
lossless tests can run on each without a download. Their text is garbage; greedy decoding is not
degenerate (checked at build time: the generated tokens are not all one token, and not EOS).

Lifecycle of ``build_shape(name)``:

1. if ``<cache>/models/<name>`` holds a checkpoint whose manifest matches this shape's config
   fingerprint and whose files still have their recorded sizes and hashes, stop (idempotent);
2. otherwise build the transformers config, initialise the model with a fixed seed (weights drawn
   with ``init_std``, large enough that the logits have clear winners), save it with
   ``save_pretrained`` beside the default model's tokenizer files (the vocabulary is the default
   model's), run a short greedy generation as a check, write the manifest and move the directory
   into place atomically.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from sglang_lynx.models.catalog import DEFAULT_MODEL, SHAPES, ShapeSpec, get_shape, model_dir
from sglang_lynx.models.prepare import ModelPrepareError, check_checkpoint, install_checkpoint, prepare

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CHECK_PROMPT = "The lighthouse keeper wrote in his log that"
CHECK_TOKENS = 12


def _config(spec: ShapeSpec, tokenizer_dir: Path) -> Any:
    import transformers

    base = json.loads((tokenizer_dir / "config.json").read_text())
    config_class = getattr(transformers, spec.config_class)
    common = {
        "vocab_size": base["vocab_size"], "bos_token_id": base["bos_token_id"], "eos_token_id": base["eos_token_id"],
        "pad_token_id": base.get("pad_token_id"), "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": 8192, "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": spec.init_std, "dtype": "float32",
    }
    return config_class(**common, **dict(spec.extra))


def fingerprint(spec: ShapeSpec) -> str:
    """What the checkpoint is built from: the spec and the builder's seed (not the library version)."""
    return hashlib.sha256(json.dumps([repr(spec), spec.seed], sort_keys=True).encode()).hexdigest()


def _check_generation(model: Any, tokenizer: Any, eos_token_id: int) -> list[int]:
    import torch

    ids = tokenizer(CHECK_PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=CHECK_TOKENS, min_new_tokens=CHECK_TOKENS, do_sample=False)
    generated = [int(t) for t in out[0, ids["input_ids"].shape[1]:]]
    if len(set(generated)) < 3 or eos_token_id in generated:
        raise ModelPrepareError(f"greedy check: the random model is degenerate (generated {generated}); "
                                "raise init_std or change the seed")
    return generated


def _build(spec: ShapeSpec, tokenizer_dir: Path, out: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _config(spec, tokenizer_dir)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if model.config.model_type != spec.model_type:
        raise ModelPrepareError(f"{spec.config_class} built a {model.config.model_type!r} model")
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    return _check_generation(model, tokenizer, int(config.eos_token_id))


def build_shape(name: str, *, root: Path | None = None, force: bool = False) -> Path:
    """Make sure the random checkpoint of shape ``name`` exists and is valid; return its directory."""
    spec = get_shape(name)
    target = model_dir(name, root)
    print_ = lambda msg: print(f"[models] {msg}", file=sys.stderr)  # noqa: E731
    source = fingerprint(spec)
    if not force and target.exists():
        problems = check_checkpoint(target, source)
        if not problems:
            return target
        print_(f"rebuilding {target}: {'; '.join(problems)}")
    tokenizer_dir = prepare(DEFAULT_MODEL, root=root)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    generated: list[int] = []

    def build(scratch: Path) -> dict[str, Any]:
        generated.extend(_build(spec, tokenizer_dir, scratch))
        return {"model": name, "source": f"random init of {spec.config_class} (seed {spec.seed})",
                "source_sha256": source, "tokenizer_from": DEFAULT_MODEL,
                "check": {"prompt": CHECK_PROMPT, "generated_ids": list(generated)}}

    install_checkpoint(target, build)
    print_(f"built {name} in {time.monotonic() - started:.1f} s (greedy check: {generated})")
    return target


def build_all(root: Path | None = None) -> list[Path]:
    return [build_shape(name, root=root) for name in sorted(SHAPES)]
