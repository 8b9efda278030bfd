"""Aggregate per-instance result records into tables (pure functions over plain dicts).

Records are the JSON lines `run_eval` writes (one per task instance). Accuracy of one
(mode, task, context) cell: the mean score over instances of each seed (depths averaged), then
mean / std (population) / min / max across seeds. A failed request scores 0 and is counted in the
`errors` column, so a mode that times out cannot look accurate. Agreement rows compare each mode's
output tokens with the reference (bf16) record of the same `instance_id`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmark.accuracy.scorers import token_agreement
from benchmark.jsonl import read_jsonl

Record = dict[str, Any]
CellKey = tuple[str, str, int]


def load_records(path: Path) -> list[Record]:
    return read_jsonl(path)


def cell_key(record: Record) -> CellKey:
    return (str(record["mode"]), str(record["task"]), int(record["context_tokens_target"]))


@dataclass(frozen=True)
class AccuracyRow:
    mode: str
    task: str
    context_tokens: int
    mean: float
    std: float
    minimum: float
    maximum: float
    seeds: int
    instances: int
    errors: int


def accuracy_rows(records: Iterable[Record]) -> list[AccuracyRow]:
    per_seed: dict[CellKey, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    errors: dict[CellKey, int] = defaultdict(int)
    for record in records:
        key = cell_key(record)
        per_seed[key][int(record["seed"])].append(float(record["score"]))
        errors[key] += record["status"] != "ok"
    rows = []
    for key in sorted(per_seed):
        seed_means = [statistics.fmean(scores) for scores in per_seed[key].values()]
        rows.append(
            AccuracyRow(
                *key,
                mean=statistics.fmean(seed_means),
                std=statistics.pstdev(seed_means),
                minimum=min(seed_means),
                maximum=max(seed_means),
                seeds=len(seed_means),
                instances=sum(len(s) for s in per_seed[key].values()),
                errors=errors[key],
            )
        )
    return rows


def accuracy_table(rows: Sequence[AccuracyRow]) -> str:
    lines = [
        "| mode | task | context | accuracy (seed mean) | std | min | max | seeds | instances | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.task} | {r.context_tokens} | {r.mean:.3f} | {r.std:.3f} | {r.minimum:.3f} "
            f"| {r.maximum:.3f} | {r.seeds} | {r.instances} | {r.errors} |"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class AgreementRow:
    mode: str
    task: str
    context_tokens: int
    matched: int
    mean_common_prefix: float
    mean_match_rate: float
    identical_fraction: float
    accuracy_delta: float


def agreement_rows(reference: Sequence[Record], candidates: Sequence[Record]) -> list[AgreementRow]:
    """Token agreement of every candidate record with the reference record of the same instance.
    Only records whose request succeeded on both sides and that carry tokens of one kind count."""
    by_id = {r["instance_id"]: r for r in reference if r["status"] == "ok"}
    cells: dict[CellKey, list[tuple[int, float, bool, float]]] = defaultdict(list)
    for record in candidates:
        ref = by_id.get(record["instance_id"])
        if ref is None or record["status"] != "ok":
            continue
        if record["token_kind"] != ref["token_kind"] or record["token_kind"] == "none":
            raise ValueError(
                f"{record['instance_id']}: token kinds differ or are missing "
                f"({record['token_kind']} vs {ref['token_kind']}); use the same API for every mode"
            )
        agree = token_agreement(ref["output_tokens"], record["output_tokens"])
        identical = ref["output_tokens"] == record["output_tokens"]
        cells[cell_key(record)].append(
            (agree.common_prefix, agree.match_rate, identical, float(record["score"]) - float(ref["score"]))
        )
    rows = []
    for key in sorted(cells):
        values = cells[key]
        rows.append(
            AgreementRow(
                *key,
                matched=len(values),
                mean_common_prefix=statistics.fmean(v[0] for v in values),
                mean_match_rate=statistics.fmean(v[1] for v in values),
                identical_fraction=statistics.fmean(1.0 if v[2] else 0.0 for v in values),
                accuracy_delta=statistics.fmean(v[3] for v in values),
            )
        )
    return rows


def agreement_table(rows: Sequence[AgreementRow], reference_mode: str) -> str:
    lines = [
        f"| mode | task | context | matched | common prefix (tokens) | token match rate | identical "
        f"| accuracy - {reference_mode} |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.task} | {r.context_tokens} | {r.matched} | {r.mean_common_prefix:.1f} "
            f"| {r.mean_match_rate:.3f} | {r.identical_fraction:.3f} | {r.accuracy_delta:+.3f} |"
        )
    return "\n".join(lines) + "\n"
