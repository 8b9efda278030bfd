"""Per-mode summary of accuracy records: one row per (mode, context length) over a set of tasks.

Pure functions over the records ``run_eval`` writes (one JSON line per instance). The score of a
mode at one context length: for every seed, the mean over the tasks of that seed's task score (the
seed's instances of the task, depths averaged), then mean / population std / min / max across
seeds -- the seed-spread convention of ``aggregate.accuracy_rows`` one level up. Every task weighs
the same (the depth-swept tasks have more instances than needle_multi), so the mean is the mean of
the per-task rows of ``accuracy_rows``. A failed request scores 0 and is counted in ``errors``.

``delta_points`` is 100 x (mean - reference mean) at the same context length. ``identical`` /
``matched`` count the instances whose output tokens equal those of the reference record with the
same ``instance_id`` (pairs where both requests succeeded). A summary that cannot be computed
honestly raises ``ValueError``: a record listed twice, a seed that lacks one of the tasks, a
(mode, context) cell that lacks a task, tokens of different kinds on the two sides.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from benchmark.accuracy.aggregate import Record

SummaryKey = tuple[str, int]  # (mode, context length)


@dataclass(frozen=True)
class ModeSummary:
    mode: str
    context_tokens: int
    tasks: tuple[str, ...]
    mean: float
    std: float
    minimum: float
    maximum: float
    seeds: int
    instances: int
    errors: int
    delta_points: float | None = None  # against the reference mode at the same context
    identical: int | None = None  # output tokens equal to the reference record's
    matched: int | None = None  # instances compared with the reference (both requests ok)


def _key(record: Record) -> SummaryKey:
    return str(record["mode"]), int(record["context_tokens_target"])


def check_unique(records: Iterable[Record]) -> list[Record]:
    """The records as a list; a (mode, instance_id) seen twice raises (it would count twice)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for record in records:
        ident = (str(record["mode"]), str(record["instance_id"]))
        if ident in seen:
            raise ValueError(f"record {ident[1]} of mode {ident[0]} appears twice")
        seen.add(ident)
        out.append(record)
    return out


def common_tasks(records: Iterable[Record]) -> tuple[str, ...]:
    """Tasks present in every (mode, context length) cell of ``records`` (sorted)."""
    tasks: dict[SummaryKey, set[str]] = defaultdict(set)
    for record in records:
        tasks[_key(record)].add(str(record["task"]))
    if not tasks:
        return ()
    return tuple(sorted(set.intersection(*tasks.values())))


def identical_counts(reference: Sequence[Record], candidates: Sequence[Record]) -> dict[SummaryKey, tuple[int, int]]:
    """(identical, matched) per candidate (mode, context): output tokens against the reference record
    of the same instance, over pairs whose requests both succeeded."""
    by_id = {r["instance_id"]: r for r in reference if r["status"] == "ok"}
    counts: dict[SummaryKey, list[int]] = defaultdict(lambda: [0, 0])
    for record in candidates:
        ref = by_id.get(record["instance_id"])
        if ref is None or record["status"] != "ok":
            continue
        if record["token_kind"] != ref["token_kind"] or record["token_kind"] == "none":
            raise ValueError(f"{record['instance_id']}: token kinds differ or are missing "
                             f"({record['token_kind']} vs {ref['token_kind']})")
        cell = counts[_key(record)]
        cell[0] += record["output_tokens"] == ref["output_tokens"]
        cell[1] += 1
    return {key: (value[0], value[1]) for key, value in counts.items()}


def mode_summaries(records: Iterable[Record], tasks: Sequence[str] | None = None,
                   reference_mode: str = "bf16") -> list[ModeSummary]:
    """One row per (mode, context) over ``tasks`` (default: the tasks every cell has); records of
    other tasks are left out. Sorted by mode, then context length."""
    records = check_unique(records)
    chosen = tuple(sorted(tasks)) if tasks is not None else common_tasks(records)
    if not chosen:
        raise ValueError("no task is present in every (mode, context) cell")
    wanted = set(chosen)
    kept = [r for r in records if r["task"] in wanted]
    scores: dict[SummaryKey, dict[int, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    errors: dict[SummaryKey, int] = defaultdict(int)
    for record in kept:
        scores[_key(record)][int(record["seed"])][str(record["task"])].append(float(record["score"]))
        errors[_key(record)] += record["status"] != "ok"
    rows: dict[SummaryKey, ModeSummary] = {}
    for key in sorted(scores):
        seed_means = []
        present = {task for per_task in scores[key].values() for task in per_task}
        if present != wanted:
            raise ValueError(f"{key[0]} at {key[1]} tokens lacks task(s) {sorted(wanted - present)}")
        for seed, per_task in sorted(scores[key].items()):
            if set(per_task) != wanted:
                raise ValueError(f"{key[0]} at {key[1]} tokens: seed {seed} lacks task(s) "
                                 f"{sorted(wanted - set(per_task))}")
            seed_means.append(statistics.fmean(statistics.fmean(per_task[t]) for t in chosen))
        rows[key] = ModeSummary(key[0], key[1], chosen, mean=statistics.fmean(seed_means),
                                std=statistics.pstdev(seed_means), minimum=min(seed_means), maximum=max(seed_means),
                                seeds=len(seed_means), instances=sum(len(v) for s in scores[key].values()
                                                                     for v in s.values()),
                                errors=errors[key])
    reference = [r for r in kept if r["mode"] == reference_mode]
    same = identical_counts(reference, [r for r in kept if r["mode"] != reference_mode])
    out = []
    for (mode, context), row in rows.items():
        ref_row = rows.get((reference_mode, context))
        if ref_row is None or mode == reference_mode:
            out.append(row)
            continue
        identical, matched = same.get((mode, context), (0, 0))
        out.append(dataclasses.replace(row, delta_points=100.0 * (row.mean - ref_row.mean), identical=identical,
                                     matched=matched))
    return out

