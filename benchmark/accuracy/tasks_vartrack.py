"""Variable tracking: follow a chain of assignments hidden in filler text.

A chain "VAR A = 12345", "VAR B = VAR A", "VAR C = VAR B", ... (`hops` + 1 statements) is spread
at even depths through the filler, and a distractor chain with a different value is interleaved.
The model must name every variable that ends up holding the chain's value (SET_F1 over the
5-capital-letter names in the output). Filler contains no "VAR" statements and no digits, so the
answer follows from the statements alone.
"""

from __future__ import annotations

from benchmark.accuracy.haystack import build_haystack
from benchmark.accuracy.task_common import (
    distinct,
    filler_budget,
    random_number,
    random_upper_word,
    task_rng,
    user_messages,
    validate_context_tokens,
)
from benchmark.accuracy.task_types import Metric, TaskInstance, TaskMetadata, TaskName
from benchmark.accuracy.token_count import TokenCounter

NAME_PATTERN = r"\b[A-Z]{5}\b"


def chain_statements(names: list[str], value: str) -> list[str]:
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
    return statements


def vartrack_prompt(context: str, value: str) -> str:
    return (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        f"{context}\n\n"
        f"Question: Find all variables that are assigned the value {value} in the text above. "
        "Answer with the variable names only, separated by commas."
    )


def generate_variable_tracking(
    seed: int, context_tokens: int, counter: TokenCounter, hops: int = 4
) -> TaskInstance:
    validate_context_tokens(context_tokens)
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    rng = task_rng(TaskName.VARIABLE_TRACKING, seed, context_tokens, None)
    names = distinct(rng, random_upper_word, 2 * (hops + 1))
    target_names, distractor_names = names[: hops + 1], names[hops + 1 :]
    value, distractor_value = distinct(rng, lambda r: random_number(r, 5), 2)
    statements = chain_statements(target_names, value)
    distractors = chain_statements(distractor_names, distractor_value)
    count = len(statements)
    depths = tuple(round((i + 0.5) / count, 3) for i in range(count))
    pieces = [(d, s) for d, s in zip(depths, statements, strict=True)]
    pieces += [(min(d + 0.5 / count, 1.0), s) for d, s in zip(depths, distractors, strict=True)]
    fixed = vartrack_prompt(" ".join(statements + distractors), value)
    haystack = build_haystack(seed, filler_budget(context_tokens, counter, fixed), counter, pieces)
    content = vartrack_prompt(haystack.text, value)
    metadata = TaskMetadata(
        TaskName.VARIABLE_TRACKING, context_tokens, counter.count(content), counter.method, None, seed, depths
    )
    return TaskInstance(user_messages(content), tuple(target_names), NAME_PATTERN, Metric.SET_F1, metadata)
