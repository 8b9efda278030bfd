"""Helpers shared by the task generators (pure functions).

Every generator follows the same recipe: draw the task's secret facts from a seeded
`random.Random`, write the prompt with an empty context to learn the fixed token overhead, build a
haystack of (target - overhead) filler tokens with the facts inserted at their depths, then count
the final prompt again for the metadata. Invariant: the same arguments give the same instance.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from benchmark.accuracy.task_types import Message, TaskName
from benchmark.accuracy.token_count import TokenCounter

MIN_CONTEXT_TOKENS = 256


def task_rng(task: TaskName, seed: int, context_tokens: int, depth: float | None) -> random.Random:
    return random.Random(f"{task.value}:{seed}:{context_tokens}:{depth}")


def validate_context_tokens(context_tokens: int) -> int:
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be >= {MIN_CONTEXT_TOKENS}, got {context_tokens}")
    return context_tokens


def filler_budget(context_tokens: int, counter: TokenCounter, fixed_text: str) -> int:
    return max(context_tokens - counter.count(fixed_text), 0)


def user_messages(content: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": content},)


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def random_upper_word(rng: random.Random, length: int = 5) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(length))


def random_uuid_like(rng: random.Random) -> str:
    hex_digits = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return "-".join((hex_digits[:8], hex_digits[8:12], hex_digits[12:16], hex_digits[16:20], hex_digits[20:]))


def distinct(rng: random.Random, draw: Callable[[random.Random], str], count: int) -> list[str]:
    """`count` distinct values of `draw(rng)`, in draw order."""
    values: list[str] = []
    while len(values) < count:
        value = draw(rng)
        if value not in values:
            values.append(value)
    return values
