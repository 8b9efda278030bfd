"""Build a filler context of a target token length and insert pieces of text at given depths.

Pure functions. `build_haystack` draws sentences from `FillerTextGenerator(seed)` until the filler
reaches `filler_token_budget` (measured by the run's `TokenCounter`, summed per sentence), then
inserts each `(depth, text)` at the sentence boundary nearest to `depth * number_of_sentences`.
Invariants: depth 0 puts a piece before all filler, depth 1 after all of it; pieces keep their
relative order for equal depths; `Haystack.offsets[i]` is the character offset of piece i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmark.accuracy.filler_text import FillerTextGenerator
from benchmark.accuracy.token_count import TokenCounter

MAX_CONTEXT_TOKENS = 200_000


@dataclass(frozen=True)
class Haystack:
    text: str
    offsets: tuple[int, ...]
    filler_sentences: int


def validate_depth(depth: float) -> float:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return depth


def filler_sentences(seed: int, token_budget: int, counter: TokenCounter) -> list[str]:
    """Sentences whose summed token count (plus one separator each) stays within the budget."""
    if token_budget > MAX_CONTEXT_TOKENS:
        raise ValueError(f"context of {token_budget} tokens exceeds the supported {MAX_CONTEXT_TOKENS}")
    stream = FillerTextGenerator(seed).sentences()
    sentences: list[str] = []
    pending = next(stream)
    used = 0
    # Two passes: per-sentence costs overestimate a joined text a little (rounding, merges), so the
    # second pass re-measures the joined text once and spends what is left of the budget.
    for _ in range(2):
        while used + (cost := counter.count(" " + pending)) <= token_budget:
            sentences.append(pending)
            used += cost
            pending = next(stream)
        used = counter.count(" ".join(sentences))
    return sentences


def build_haystack(
    seed: int, filler_token_budget: int, counter: TokenCounter, pieces: Sequence[tuple[float, str]]
) -> Haystack:
    sentences = filler_sentences(seed, max(filler_token_budget, 0), counter)
    n = len(sentences)
    slots = [round(validate_depth(depth) * n) for depth, _ in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (slots[i], i))
    parts: list[str] = []
    offsets = [0] * len(pieces)
    position = 0
    cursor = 0
    for index in order:
        while cursor < slots[index]:
            parts.append(sentences[cursor])
            position += len(sentences[cursor]) + 1
            cursor += 1
        offsets[index] = position
        parts.append(pieces[index][1])
        position += len(pieces[index][1]) + 1
    parts.extend(sentences[cursor:])
    return Haystack(text=" ".join(parts), offsets=tuple(offsets), filler_sentences=n)
