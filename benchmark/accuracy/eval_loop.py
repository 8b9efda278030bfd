"""Send task instances to a server with bounded concurrency and a bounded total time; score them.

Lifecycle: `run_instances` starts `concurrency` daemon worker threads that take instance indices
from a queue, so at most `concurrency` requests are in flight; each request is bounded by the
client's socket timeout and the whole run by `deadline_s`. At the deadline the workers are told to
stop taking work; instances never started are recorded as `not_sent`, those still in flight as
`timeout` (both score 0), and the function returns without waiting for them. Every instance yields
exactly one record, in the order of the input. `make_record` is a pure function.
"""

from __future__ import annotations

import queue
import threading
import time
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
    work: queue.Queue[int] = queue.Queue()
    for index in range(len(instances)):
        work.put(index)
    done: queue.Queue[tuple[int, Completion]] = queue.Queue()
    in_flight: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            with lock:
                in_flight.add(index)
            completion = client.complete(instances[index])
            with lock:
                in_flight.discard(index)
            done.put((index, completion))

    # Daemon threads: a request still blocked in its socket timeout at the deadline cannot hold
    # up the caller or interpreter exit (a ThreadPoolExecutor joins its workers at exit).
    for number in range(min(concurrency, len(instances))):
        threading.Thread(target=worker, name=f"accuracy-eval-{number}", daemon=True).start()
    records: list[Record | None] = [None] * len(instances)
    end = time.monotonic() + deadline_s
    received = 0
    while received < len(instances):
        try:
            index, completion = done.get(timeout=max(end - time.monotonic(), 0.0))
        except queue.Empty:
            break
        received += 1
        record = make_record(instances[index], completion, mode, client.api.value)
        records[index] = record
        if on_record is not None:
            on_record(record)
    stop.set()
    with lock:
        running = set(in_flight)
    for index, existing in enumerate(records):
        if existing is None:
            status = RequestStatus.TIMEOUT if index in running else RequestStatus.NOT_SENT
            missed = Completion(status, error=f"run deadline of {deadline_s}s reached")
            records[index] = make_record(instances[index], missed, mode, client.api.value)
    return [record for record in records if record is not None]
