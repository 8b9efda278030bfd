"""Data types shared by the task generators, scorers and the runner.

A `TaskInstance` is immutable once generated: the chat prompt (a plain list of messages for an
instruct model), the expected answers, how to score them (`Metric`), `echo_spans` (answer-shaped
strings from the question itself, e.g. the queried key, that a model may repeat before answering
and that the scorer skips) and the metadata that identifies it (task, target and estimated context
tokens, estimation method, depth, seed).
Invariant: `instance_id` is a pure function of (task, target context tokens, depth, seed), so the
same instance across result files of different modes can be matched for token agreement.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class TaskName(str, enum.Enum):
    NEEDLE_SINGLE = "needle_single"
    NEEDLE_MULTI = "needle_multi"
    KV_RETRIEVAL = "kv_retrieval"
    VARIABLE_TRACKING = "variable_tracking"
    DOCUMENT_QA = "document_qa"


class Metric(str, enum.Enum):
    """EXACT_MATCH: first answer-shaped span of the output equals the (single) answer, normalised.
    ALL_FOUND: fraction of expected answers among the answer-shaped spans of the output.
    SET_F1: F1 between the set of answer-shaped spans in the output and the expected set.
    ROUGE_L: LCS-based ROUGE-L F1 of output words against the reference answer text."""

    EXACT_MATCH = "exact_match"
    ALL_FOUND = "all_found"
    SET_F1 = "set_f1"
    ROUGE_L = "rouge_l"


Message = dict[str, str]


def make_instance_id(task: TaskName, context_tokens_target: int, depth: float | None, seed: int) -> str:
    depth_part = "na" if depth is None else f"{depth:.3f}"
    return f"{task.value}/ctx{context_tokens_target}/depth{depth_part}/seed{seed}"


@dataclass(frozen=True)
class TaskMetadata:
    task: TaskName
    context_tokens_target: int
    context_tokens_approx: int
    token_count_method: str
    depth: float | None
    seed: int
    needle_depths: tuple[float, ...] = ()

    @property
    def instance_id(self) -> str:
        return make_instance_id(self.task, self.context_tokens_target, self.depth, self.seed)


@dataclass(frozen=True)
class TaskInstance:
    messages: tuple[Message, ...]
    expected_answers: tuple[str, ...]
    answer_pattern: str
    metric: Metric
    metadata: TaskMetadata
    echo_spans: tuple[str, ...] = ()

    @property
    def instance_id(self) -> str:
        return self.metadata.instance_id

    @property
    def prompt_text(self) -> str:
        return "\n".join(message["content"] for message in self.messages)

    def to_json_dict(self) -> dict[str, Any]:
        meta = asdict(self.metadata)
        meta["task"] = self.metadata.task.value
        meta["needle_depths"] = list(self.metadata.needle_depths)
        return {
            "instance_id": self.instance_id,
            "expected_answers": list(self.expected_answers),
            "metric": self.metric.value,
            "metadata": meta,
        }
