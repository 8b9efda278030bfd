"""The evaluation runner against a loopback fake server: scoring, bounds, files, comparison."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from accuracy_fake_server import FakeServer
from benchmark.accuracy.aggregate import accuracy_rows, agreement_rows, load_records
from benchmark.accuracy.eval_loop import run_instances
from benchmark.accuracy.http_client import ApiKind, CompletionClient, RequestStatus, render_chatml
from benchmark.accuracy.run_eval import main
from benchmark.accuracy.task_registry import generate_instances
from benchmark.accuracy.task_types import TaskName
from benchmark.accuracy.token_count import TokenCounter


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer().start()
    yield fake
    fake.stop()


def needle_grid(counter: TokenCounter, seeds: int = 2) -> list:
    tasks = [TaskName.NEEDLE_SINGLE, TaskName.NEEDLE_MULTI]
    return generate_instances(tasks, [512], list(range(seeds)), counter, depths=(0.0, 1.0))


@pytest.mark.parametrize("api", [ApiKind.NATIVE, ApiKind.OPENAI])
def test_correct_and_wrong_servers_score_one_and_zero(
    server: FakeServer, counter: TokenCounter, api: ApiKind
) -> None:
    instances = needle_grid(counter)
    client = CompletionClient(server.url, api, 16, timeout_s=10)
    good = run_instances(client, instances, "bf16", concurrency=2, deadline_s=30)
    assert [r["instance_id"] for r in good] == [i.instance_id for i in instances]
    assert all(r["status"] == "ok" and r["score"] == 1.0 for r in good)
    assert good[0]["token_kind"] == ("ids" if api is ApiKind.NATIVE else "strings")
    server.state.wrong = True
    bad = run_instances(client, instances, "int4", concurrency=2, deadline_s=30)
    assert all(r["status"] == "ok" and r["score"] == 0.0 for r in bad)
    agreement = agreement_rows(good, bad)
    assert all(row.mean_match_rate < 0.5 and row.identical_fraction == 0.0 for row in agreement)
    assert all(row.accuracy_delta == -1.0 for row in agreement)


def test_concurrency_is_bounded(server: FakeServer, counter: TokenCounter) -> None:
    server.state.delay_s = 0.1
    client = CompletionClient(server.url, ApiKind.NATIVE, 8, timeout_s=10)
    records = run_instances(client, needle_grid(counter, seeds=3), "bf16", concurrency=2, deadline_s=30)
    assert len(records) == 3 * (2 + 1)
    assert server.state.peak_in_flight == 2


def test_timeouts_and_deadline_are_recorded_as_failures(server: FakeServer, counter: TokenCounter) -> None:
    server.state.delay_s = 1.5
    instances = needle_grid(counter)
    client = CompletionClient(server.url, ApiKind.NATIVE, 8, timeout_s=0.3)
    records = run_instances(client, instances[:2], "bf16", concurrency=2, deadline_s=30)
    assert [r["status"] for r in records] == ["timeout", "timeout"]
    assert all(r["score"] == 0.0 for r in records)
    slow = CompletionClient(server.url, ApiKind.NATIVE, 8, timeout_s=10)
    started = time.monotonic()
    records = run_instances(slow, instances, "bf16", concurrency=1, deadline_s=0.5)
    assert time.monotonic() - started < 1.2  # returns at the deadline, not when the request ends
    statuses = [r["status"] for r in records]
    assert statuses[0] == "timeout" and set(statuses[1:]) == {"not_sent"}
    rows = accuracy_rows(records)
    assert sum(row.errors for row in rows) == len(instances)


def test_unreachable_server_is_a_connection_error(counter: TokenCounter) -> None:
    client = CompletionClient("http://127.0.0.1:9", ApiKind.NATIVE, 8, timeout_s=2)
    completion = client.complete(needle_grid(counter)[0])
    assert completion.status is RequestStatus.CONNECTION_ERROR
    assert completion.error


def test_cli_writes_results_tables_plot_and_comparison(server: FakeServer, tmp_path: Path) -> None:
    common = ["--url", server.url, "--tasks", "needle_single,needle_multi", "--context-lengths", "512,1024",
              "--seeds", "0,1", "--depths", "0,1", "--max-new-tokens", "8", "--timeout-s", "10",
              "--tokenizer", str(tmp_path / "no-tokenizer")]
    assert main([*common, "--mode", "bf16", "--out-dir", str(tmp_path)]) == 0
    server.state.wrong = True
    assert main([*common, "--mode", "int4", "--out-dir", str(tmp_path)]) == 0
    bf16 = load_records(tmp_path / "bf16.jsonl")
    assert len(bf16) == 2 * 2 * 2 + 2 * 2
    assert {r["chat_render"] for r in bf16} == {"chatml"}
    assert (tmp_path / "bf16_accuracy.png").stat().st_size > 1000
    assert "| bf16 | needle_single | 512 | 1.000 |" in (tmp_path / "bf16_accuracy.md").read_text()
    assert main(["--compare", str(tmp_path / "int4.jsonl"), "--reference", str(tmp_path / "bf16.jsonl"),
                 "--out-dir", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "comparison_accuracy.md").read_text()
    assert "| int4 | needle_multi | 1024 | 0.000 |" in table
    assert "| bf16 | needle_multi | 1024 | 1.000 |" in table
    assert "-1.000" in (tmp_path / "cmp" / "comparison_agreement.md").read_text()
    assert (tmp_path / "cmp" / "accuracy_vs_context.png").exists()


def test_chatml_rendering_and_payload_shape(counter: TokenCounter) -> None:
    rendered = render_chatml([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    client = CompletionClient("http://x", ApiKind.NATIVE, 7, timeout_s=1)
    payload = client.payload(needle_grid(counter)[0])
    assert payload["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 7}
    assert json.dumps(payload)
    with pytest.raises(ValueError):
        CompletionClient("http://x", ApiKind.NATIVE, 0, timeout_s=1)
