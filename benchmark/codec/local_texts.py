"""Local text contexts for codec measurements (no downloads): stdlib sources, licences, docs.

``build_contexts(tokenizer, num, tokens, seed)`` returns ``num`` token-id lists of exactly ``tokens``
ids, one per distinct local file, each a window at a seeded random offset of that file.
"""

from __future__ import annotations

import glob
import random
from typing import Any

SOURCES = (
    "/usr/share/common-licenses/*",
    "/usr/lib/python3.11/*.py",
    "/usr/lib/python3.11/*/*.py",
    "/usr/share/doc/*/copyright",
    "/usr/share/perl/*/pod/*.pod",
    "/usr/share/vim/vim*/doc/*.txt",
)
MAX_CHARS = 80_000


def local_files() -> list[str]:
    files: list[str] = []
    for pattern in SOURCES:
        files.extend(sorted(glob.glob(pattern)))
    return files


def build_contexts(tokenizer: Any, num: int, tokens: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    files = local_files()
    rng.shuffle(files)
    contexts: list[tuple[str, list[int]]] = []
    for path in files:
        if len(contexts) >= num:
            break
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read(MAX_CHARS)
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < tokens * 2:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < tokens:
            continue
        start = rng.randrange(0, len(ids) - tokens + 1)
        contexts.append((path, ids[start : start + tokens]))
    if len(contexts) < num:
        raise RuntimeError(f"only {len(contexts)} local files hold {tokens} tokens; asked for {num}")
    return contexts
