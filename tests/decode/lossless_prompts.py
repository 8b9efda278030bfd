"""The prompts of the bf16 losslessness test: our own generators and texts, varied in kind and length.

Four kinds, every one deterministic (same list on every machine):
- ``short``: one-line instructions and questions (5-20 tokens: the whole prompt inside the codec's
  full-precision trailer, so drafts run on exact KV);
- ``code``: windows of local Python sources (this interpreter's ``os``, ``json`` and ``argparse``
  modules), 120-1,500 tokens;
- ``needle``: the project's filler prose with one fact hidden at a varied depth and a question
  after it, 150-1,400 tokens;
- ``continuation``: filler prose cut mid-sentence, to be continued, 100-1,200 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from benchmark.accuracy.filler_text import FillerTextGenerator

SHORT = [
    "The capital of France is", "Write one sentence about the sea:", "def add(a, b):",
    "List three colours:", "Translate 'good morning' to French:", "What is 12 times 7?",
    "Once upon a time, in a small village,", "The three laws of motion are", "import numpy as np\n",
    "Explain photosynthesis in one line:", "A haiku about autumn:", "The best way to learn a language is",
    "Q: What is the boiling point of water?\nA:", "Name a famous painter:", "SELECT * FROM",
    "The recipe for pancakes needs", "Dear team, I am writing to", "In 1969, humans",
    "The opposite of hot is", "Summarise: The cat sat on the mat.",
]
CHARS_PER_TOKEN = 4  # rough, for sizing windows; the server counts the real tokens


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str
    text: str


def _filler(seed: int, approx_tokens: int) -> str:
    gen = FillerTextGenerator(seed)
    out: list[str] = []
    while sum(len(s) for s in out) < approx_tokens * CHARS_PER_TOKEN:
        out.append(gen.sentence())
    return " ".join(out)


def _sources() -> str:
    return "".join(Path(m.__file__).read_text() for m in (os, json, argparse) if m.__file__)


def lossless_prompts(per_kind: int = 30, seed: int = 16) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = [Prompt(f"short{i}", "short", text) for i, text in enumerate(SHORT)]
    source = _sources()
    for i in range(per_kind):
        size = rng.randint(120, 1500) * CHARS_PER_TOKEN
        start = rng.randrange(0, len(source) - size)
        prompts.append(Prompt(f"code{i}", "code", source[start: start + size]))
    for i in range(per_kind):
        tokens = rng.randint(150, 1400)
        text = _filler(1000 + i, tokens)
        code = rng.randint(1000, 9999)
        cut = int(len(text) * rng.choice((0.1, 0.3, 0.5, 0.7, 0.9)))
        cut = text.rfind(". ", 0, cut) + 2 if ". " in text[:cut] else 0
        needle = f"The secret number of the harbour is {code}. "
        prompts.append(Prompt(f"needle{i}", "needle",
                              text[:cut] + needle + text[cut:] + "\nQuestion: what is the secret number of the harbour?"
                              " Answer:"))
    for i in range(per_kind):
        text = _filler(5000 + i, rng.randint(100, 1200))
        prompts.append(Prompt(f"continuation{i}", "continuation", text[: text.rfind(" ", 0, len(text) - 20)]))
    return prompts


if __name__ == "__main__":  # a look at the list: python tests/decode/lossless_prompts.py
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-kind", type=int, default=30)
    args = parser.parse_args()
    for p in lossless_prompts(args.per_kind):
        print(p.name, p.kind, len(p.text), repr(p.text[:60]))
