"""Send task instances to a server with bounded concurrency and a bounded total time; score them.

Lifecycle: `run_instances` owns one thread pool for its duration: at most `concurrency` requests
are in flight; each request is bounded by the client's socket timeout and the whole run by
`deadline_s`. Instances still queued at the deadline are recorded with status `not_sent` (score 0)
and never sent; the pool is shut down without waiting for queued work. Every instance yields
exactly one record, in the order of the input. `make_record` is a pure function.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence

from benchmark.accuracy.aggregate import Record
from benchmark.accuracy.http_client import Completion, CompletionClient, RequestStatus
from benchmark.accuracy.scorers import score_instance
from benchmark.accuracy.task_types import TaskInstance


def make_record(instance: TaskInstance, completion: Completion, mode: str, api: str) -> Record:
    meta = instance.metadata
    ok = completion.status is RequestStatus.OK
    return {
        "instance_id": instance.instance_id,
        "mode": mode,
        "api": api,
        "task": meta.task.value,
        "context_tokens_target": meta.context_tokens_target,
        "context_tokens_approx": meta.context_tokens_approx,
        "token_count_method": meta.token_count_method,
        "depth": meta.depth,
        "needle_depths": list(meta.needle_depths),
        "seed": meta.seed,
        "metric": instance.metric.value,
        "expected_answers": list(instance.expected_answers),
        "prediction": completion.text,
        "output_tokens": completion.tokens,
        "token_kind": completion.token_kind,
        "score": score_instance(instance, completion.text) if ok else 0.0,
        "status": completion.status.value,
        "error": completion.error,
        "latency_s": round(completion.latency_s, 4),
    }


def run_instances(
    client: CompletionClient,
    instances: Sequence[TaskInstance],
    mode: str,
    concurrency: int,
    deadline_s: float,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[Record | None] = [None] * len(instances)
    started: list[cf.Future[Completion]] = []
    pool = cf.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="accuracy-eval")
    try:
        futures = {pool.submit(client.complete, inst): i for i, inst in enumerate(instances)}
        try:
            for future in cf.as_completed(futures, timeout=deadline_s):
                index = futures[future]
                record = make_record(instances[index], future.result(), mode, client.api.value)
                records[index] = record
                if on_record is not None:
                    on_record(record)
        except cf.TimeoutError:
            started = [f for f in futures if f.running()]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    running = {futures[f] for f in started}
    for index, existing in enumerate(records):
        if existing is None:
            status = RequestStatus.TIMEOUT if index in running else RequestStatus.NOT_SENT
            missed = Completion(status, error=f"run deadline of {deadline_s}s reached")
            records[index] = make_record(instances[index], missed, mode, client.api.value)
    return [record for record in records if record is not None]
