"""Scorers: normalised exact match, answer recall, set F1, ROUGE-L F1, token agreement.

Pure functions, no state. Scores are floats in [0, 1]. `score_instance` dispatches on the task's
`Metric`. Token agreement compares a mode's output tokens with the bf16 output of the same
instance: the common-prefix length and the match rate (positions that agree, divided by the longer
sequence, so a length difference counts as disagreement; two empty sequences agree fully).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

from benchmark.accuracy.task_types import Metric, TaskInstance

_PUNCT_TABLE = str.maketrans({ch: " " for ch in string.punctuation if ch not in "-"})
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> str:
    """Lower case, punctuation (except '-') to spaces, articles dropped, whitespace collapsed."""
    lowered = text.lower().translate(_PUNCT_TABLE)
    return " ".join(_ARTICLES.sub(" ", lowered).split())


def exact_match(prediction: str, reference: str) -> float:
    return 1.0 if normalise(prediction) == normalise(reference) else 0.0


def extract_spans(prediction: str, pattern: str) -> list[str]:
    """Answer-shaped spans of the output, in order (regex `pattern`)."""
    return re.findall(pattern, prediction)


def first_span_exact_match(
    prediction: str, reference: str, pattern: str, ignore: Sequence[str] = ()
) -> float:
    """Exact match of the first answer-shaped span that is not an echo of the question (`ignore`)."""
    spans = [span for span in extract_spans(prediction, pattern) if span not in ignore]
    return exact_match(spans[0], reference) if spans else 0.0


def all_found(prediction: str, references: Sequence[str], pattern: str) -> float:
    if not references:
        raise ValueError("all_found needs at least one reference")
    spans = {normalise(span) for span in extract_spans(prediction, pattern)}
    return sum(normalise(ref) in spans for ref in references) / len(references)


def set_f1(prediction: str, references: Sequence[str], pattern: str) -> float:
    if not references:
        raise ValueError("set_f1 needs at least one reference")
    predicted = set(extract_spans(prediction, pattern))
    expected = set(references)
    hits = len(predicted & expected)
    if hits == 0:
        return 0.0
    precision, recall = hits / len(predicted), hits / len(expected)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time, O(len(b)) memory."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for item in a:
        current = [0] * (len(b) + 1)
        for j, other in enumerate(b, start=1):
            current[j] = previous[j - 1] + 1 if item == other else max(previous[j], current[j - 1])
        previous = current
    return previous[-1]


def rouge_l_f1(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1) over normalised words. Both empty: 1.0; exactly one empty: 0.0."""
    pred_words, ref_words = normalise(prediction).split(), normalise(reference).split()
    if not pred_words and not ref_words:
        return 1.0
    lcs = lcs_length(pred_words, ref_words)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred_words), lcs / len(ref_words)
    return 2 * precision * recall / (precision + recall)


def score_instance(instance: TaskInstance, prediction: str) -> float:
    metric, refs, pattern = instance.metric, instance.expected_answers, instance.answer_pattern
    if metric is Metric.EXACT_MATCH:
        return first_span_exact_match(prediction, refs[0], pattern, instance.echo_spans)
    if metric is Metric.ALL_FOUND:
        return all_found(prediction, refs, pattern)
    if metric is Metric.SET_F1:
        return set_f1(prediction, refs, pattern)
    if metric is Metric.ROUGE_L:
        return rouge_l_f1(prediction, refs[0])
    raise ValueError(f"unknown metric {metric!r}")


@dataclass(frozen=True)
class TokenAgreement:
    common_prefix: int
    match_rate: float
    reference_length: int
    candidate_length: int


def token_agreement(reference: Sequence[int | str], candidate: Sequence[int | str]) -> TokenAgreement:
    prefix = 0
    for ref_token, cand_token in zip(reference, candidate, strict=False):
        if ref_token != cand_token:
            break
        prefix += 1
    longest = max(len(reference), len(candidate))
    matches = sum(r == c for r, c in zip(reference, candidate, strict=False))
    rate = 1.0 if longest == 0 else matches / longest
    return TokenAgreement(prefix, rate, len(reference), len(candidate))
