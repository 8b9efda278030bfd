"""Token-length estimates for building contexts of a requested size.

Lifecycle: `load_token_counter(tokenizer_dir)` is called once per run. It returns an
`HFTokenCounter` when `transformers` and a local tokenizer directory are available (default: the
prepared SmolLM2-135M-Instruct under ~/.cache/sglang-lynx/models/smollm2-135m), else a
`CharsPerTokenCounter` (len(text) / 4). Every counter reports its `method` string, which is written
into each task instance's metadata so a reader knows how "context tokens" was estimated.
Invariants: counting never downloads anything (`local_files_only=True`); counts are >= 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TOKENIZER_DIR = Path(
    os.environ.get("LYNX_MODEL_CACHE", str(Path.home() / ".cache" / "sglang-lynx" / "models"))
) / "smollm2-135m"
CHARS_PER_TOKEN = 4.0


class TokenCounter(Protocol):
    method: str

    def count(self, text: str) -> int: ...


class CharsPerTokenCounter:
    """Fallback estimate: ceil(len(text) / 4)."""

    method = "chars/4"

    def count(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)


class HFTokenCounter:
    """Exact token count with a local Hugging Face tokenizer (no special tokens)."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        self.method = f"hf-tokenizer:{name}"

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        rendered = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(rendered)


def load_hf_tokenizer(tokenizer_dir: Path) -> HFTokenCounter | None:
    """Local tokenizer or None (missing directory or missing transformers)."""
    if not (tokenizer_dir / "tokenizer_config.json").exists() and not (
        tokenizer_dir / "tokenizer.json"
    ).exists():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return HFTokenCounter(tokenizer, tokenizer_dir.name)


def load_token_counter(tokenizer_dir: Path | None = None) -> TokenCounter:
    """The HF tokenizer of the default model when present, else the chars/4 estimate."""
    hf = load_hf_tokenizer(tokenizer_dir or DEFAULT_TOKENIZER_DIR)
    return hf if hf is not None else CharsPerTokenCounter()
