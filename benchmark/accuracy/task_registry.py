"""One entry point for every task: expand (tasks x context lengths x seeds x depths) into instances.

Tasks with a depth sweep (single needle, key-value, document QA) get one instance per depth;
the others (multi-needle, variable tracking) place their pieces at fixed spread depths and get
one instance per (context, seed). Pure: the same grid gives the same list in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmark.accuracy.task_types import TaskInstance, TaskName
from benchmark.accuracy.tasks_docqa import generate_document_qa
from benchmark.accuracy.tasks_kv import generate_kv_retrieval
from benchmark.accuracy.tasks_needle import generate_needle_multi, generate_needle_single
from benchmark.accuracy.tasks_vartrack import generate_variable_tracking
from benchmark.accuracy.token_count import TokenCounter

DEPTH_SWEEP_TASKS = frozenset({TaskName.NEEDLE_SINGLE, TaskName.KV_RETRIEVAL, TaskName.DOCUMENT_QA})
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def parse_task_names(names: Sequence[str]) -> list[TaskName]:
    known = {task.value: task for task in TaskName}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {sorted(known)}")
    return [known[name] for name in names]


def generate_one(
    task: TaskName,
    seed: int,
    context_tokens: int,
    depth: float | None,
    counter: TokenCounter,
    num_needles: int = 4,
    hops: int = 4,
) -> TaskInstance:
    if task in DEPTH_SWEEP_TASKS and depth is None:
        raise ValueError(f"task {task.value} needs a depth")
    if task is TaskName.NEEDLE_SINGLE:
        return generate_needle_single(seed, context_tokens, depth or 0.0, counter)
    if task is TaskName.KV_RETRIEVAL:
        return generate_kv_retrieval(seed, context_tokens, depth or 0.0, counter)
    if task is TaskName.DOCUMENT_QA:
        return generate_document_qa(seed, context_tokens, depth or 0.0, counter)
    if task is TaskName.NEEDLE_MULTI:
        return generate_needle_multi(seed, context_tokens, counter, num_needles)
    if task is TaskName.VARIABLE_TRACKING:
        return generate_variable_tracking(seed, context_tokens, counter, hops)
    raise ValueError(f"no generator for task {task!r}")


def generate_instances(
    tasks: Sequence[TaskName],
    context_lengths: Sequence[int],
    seeds: Sequence[int],
    counter: TokenCounter,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    num_needles: int = 4,
    hops: int = 4,
) -> list[TaskInstance]:
    instances: list[TaskInstance] = []
    for task in tasks:
        task_depths: Sequence[float | None] = depths if task in DEPTH_SWEEP_TASKS else (None,)
        for context_tokens in context_lengths:
            for seed in seeds:
                for depth in task_depths:
                    instances.append(
                        generate_one(task, seed, context_tokens, depth, counter, num_needles, hops)
                    )
    return instances
