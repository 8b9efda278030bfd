"""Key-value retrieval: a JSON object of UUID-like keys and values; return the value of one key.

The context is only key/value pairs (no filler), added until the token budget is spent; the
queried pair sits at index round(depth * (pairs - 1)). Scored by EXACT_MATCH on the first
UUID-shaped string of the output that is not the queried key (models often repeat the key first).
Invariant: keys and values are all distinct, so the answer is unique and derivable from the
context alone.
"""

from __future__ import annotations

import json
import random

from benchmark.accuracy.haystack import validate_depth
from benchmark.accuracy.task_common import (
    filler_budget,
    random_uuid_like,
    task_rng,
    user_messages,
    validate_context_tokens,
)
from benchmark.accuracy.task_types import Metric, TaskInstance, TaskMetadata, TaskName
from benchmark.accuracy.token_count import TokenCounter

UUID_PATTERN = r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"
MIN_PAIRS = 2


def kv_prompt(json_text: str, key: str) -> str:
    return (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        f"JSON data:\n{json_text}\n\n"
        f'Key: "{key}"\n'
        "Corresponding value (answer with the value only):"
    )


def render_pairs(pairs: list[tuple[str, str]]) -> str:
    return json.dumps(dict(pairs), indent=1)


def fill_pairs(rng: random.Random, budget: int, counter: TokenCounter) -> list[tuple[str, str]]:
    """Distinct pairs until the rendered JSON reaches `budget` tokens (per-pair sum, then re-measured)."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    used = 0
    for _ in range(2):
        while True:
            key, value = random_uuid_like(rng), random_uuid_like(rng)
            if key in seen or value in seen:
                continue
            cost = counter.count(f' "{key}": "{value}",\n')
            if used + cost > budget and len(pairs) >= MIN_PAIRS:
                break
            pairs.append((key, value))
            seen.update((key, value))
            used += cost
        used = counter.count(render_pairs(pairs)) - counter.count("{\n}")
    return pairs


def generate_kv_retrieval(
    seed: int, context_tokens: int, depth: float, counter: TokenCounter
) -> TaskInstance:
    validate_context_tokens(context_tokens)
    validate_depth(depth)
    rng = task_rng(TaskName.KV_RETRIEVAL, seed, context_tokens, depth)
    probe_key = random_uuid_like(rng)
    budget = filler_budget(context_tokens, counter, kv_prompt("{\n}", probe_key))
    pairs = fill_pairs(rng, budget, counter)
    target_index = round(depth * (len(pairs) - 1))
    key, value = pairs[target_index]
    content = kv_prompt(render_pairs(pairs), key)
    metadata = TaskMetadata(
        TaskName.KV_RETRIEVAL, context_tokens, counter.count(content), counter.method, depth, seed, (depth,)
    )
    return TaskInstance(user_messages(content), (value,), UUID_PATTERN, Metric.EXACT_MATCH, metadata, (key,))
