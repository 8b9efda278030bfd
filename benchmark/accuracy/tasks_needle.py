"""Needle-in-a-haystack tasks (single needle with a depth sweep; several needles for one key).

Single: one sentence "One of the special magic numbers for <city> is: <7 digits>." at `depth`; the
model must answer the number (EXACT_MATCH on the first 7-digit number of the output).
Multi: `num_needles` sentences with the same key and distinct numbers at evenly spread depths;
the model must list all numbers (ALL_FOUND). Filler never contains digits, so every number in the
context belongs to a needle.
"""

from __future__ import annotations

from benchmark.accuracy.haystack import build_haystack, validate_depth
from benchmark.accuracy.task_common import (
    distinct,
    filler_budget,
    random_number,
    task_rng,
    user_messages,
    validate_context_tokens,
)
from benchmark.accuracy.task_types import Metric, TaskInstance, TaskMetadata, TaskName
from benchmark.accuracy.token_count import TokenCounter

NUMBER_PATTERN = r"\b\d{7}\b"
KEYS = (
    "Lisbon", "Oslo", "Nairobi", "Quito", "Hanoi", "Tbilisi", "Reykjavik", "Montevideo",
    "Ljubljana", "Windhoek", "Ulaanbaatar", "Valletta", "Bishkek", "Canberra", "Dakar", "Tallinn",
)


def needle_sentence(key: str, number: str) -> str:
    return f"One of the special magic numbers for {key} is: {number}."


def single_prompt(context: str, key: str) -> str:
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.\n\n"
        f"{context}\n\n"
        f"What is the special magic number for {key} mentioned in the provided text? "
        "Answer with the number only."
    )


def multi_prompt(context: str, key: str, count: int) -> str:
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.\n\n"
        f"{context}\n\n"
        f"What are all the special magic numbers for {key} mentioned in the provided text? "
        f"There are {count} of them. Answer with the numbers only, separated by commas."
    )


def generate_needle_single(
    seed: int, context_tokens: int, depth: float, counter: TokenCounter
) -> TaskInstance:
    validate_context_tokens(context_tokens)
    validate_depth(depth)
    rng = task_rng(TaskName.NEEDLE_SINGLE, seed, context_tokens, depth)
    key = rng.choice(KEYS)
    number = random_number(rng)
    needle = needle_sentence(key, number)
    budget = filler_budget(context_tokens, counter, single_prompt(needle, key))
    haystack = build_haystack(seed, budget, counter, [(depth, needle)])
    content = single_prompt(haystack.text, key)
    metadata = TaskMetadata(
        TaskName.NEEDLE_SINGLE, context_tokens, counter.count(content), counter.method, depth, seed, (depth,)
    )
    return TaskInstance(user_messages(content), (number,), NUMBER_PATTERN, Metric.EXACT_MATCH, metadata)


def spread_depths(count: int) -> tuple[float, ...]:
    """Evenly spread depths strictly inside (0, 1): 1/(n+1), ..., n/(n+1)."""
    return tuple(round((i + 1) / (count + 1), 3) for i in range(count))


def generate_needle_multi(
    seed: int, context_tokens: int, counter: TokenCounter, num_needles: int = 4
) -> TaskInstance:
    validate_context_tokens(context_tokens)
    if num_needles < 2:
        raise ValueError(f"a multi-needle task needs at least 2 needles, got {num_needles}")
    rng = task_rng(TaskName.NEEDLE_MULTI, seed, context_tokens, None)
    key = rng.choice(KEYS)
    numbers = distinct(rng, random_number, num_needles)
    depths = spread_depths(num_needles)
    needles = [needle_sentence(key, number) for number in numbers]
    budget = filler_budget(context_tokens, counter, multi_prompt(" ".join(needles), key, num_needles))
    haystack = build_haystack(seed, budget, counter, list(zip(depths, needles, strict=True)))
    content = multi_prompt(haystack.text, key, num_needles)
    metadata = TaskMetadata(
        TaskName.NEEDLE_MULTI, context_tokens, counter.count(content), counter.method, None, seed, depths
    )
    return TaskInstance(user_messages(content), tuple(numbers), NUMBER_PATTERN, Metric.ALL_FOUND, metadata)
