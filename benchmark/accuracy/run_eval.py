"""Per-mode accuracy evaluation against a running server, and comparison of modes.

Evaluate (one mode, one server):
  python -m benchmark.accuracy.run_eval --url http://127.0.0.1:30000 --api native --mode bf16 \\
      --tasks needle_single,kv_retrieval --context-lengths 1024,2048 --seeds 0,1,2 --depths 0,0.5,1 \\
      --max-new-tokens 32 --concurrency 2 --timeout-s 120 --deadline-s 1800 --out-dir results/
  writes <out>/<mode>.jsonl (one record per instance), <out>/<mode>_accuracy.md and .png.
Compare (several result files, token agreement against the bf16 file):
  python -m benchmark.accuracy.run_eval --compare results/int4.jsonl results/lynx.jsonl \\
      --reference results/bf16.jsonl --out-dir results/
  writes <out>/comparison_accuracy.md, comparison_agreement.md and accuracy_vs_context.png.
Lifecycle: parse and validate arguments, check the server answers, generate instances, send them
(bounded: see eval_loop), write JSON lines as results arrive, then tables and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.accuracy.aggregate import (  # noqa: E402
    accuracy_rows,
    accuracy_table,
    agreement_rows,
    agreement_table,
    load_records,
)
from benchmark.accuracy.eval_loop import run_instances  # noqa: E402
from benchmark.accuracy.http_client import ApiKind, CompletionClient  # noqa: E402
from benchmark.accuracy.plot import plot_accuracy_vs_context  # noqa: E402
from benchmark.accuracy.task_registry import DEFAULT_DEPTHS, generate_instances, parse_task_names  # noqa: E402
from benchmark.accuracy.task_types import TaskName  # noqa: E402
from benchmark.accuracy.token_count import HFTokenCounter, load_token_counter  # noqa: E402


def csv_list(kind: type, text: str) -> list:
    return [kind(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--api", choices=[a.value for a in ApiKind], default=ApiKind.NATIVE.value)
    p.add_argument("--mode", help="label of the KV mode served (bf16, int8, lynx, ...)")
    p.add_argument("--tasks", default=",".join(t.value for t in TaskName))
    p.add_argument("--context-lengths", default="1024,2048,4096,7680")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--depths", default=",".join(str(d) for d in DEFAULT_DEPTHS))
    p.add_argument("--num-needles", type=int, default=4)
    p.add_argument("--hops", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96, help="kv_retrieval needs ~60 (key echo + value)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request socket timeout")
    p.add_argument("--deadline-s", type=float, default=3600.0, help="bound on the whole run")
    p.add_argument("--model", default="default", help="model name for the OpenAI API")
    p.add_argument("--tokenizer", type=Path, default=None, help="local HF tokenizer directory")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="write the generated instances, send nothing")
    p.add_argument("--compare", nargs="+", type=Path, help="result files to compare with --reference")
    p.add_argument("--reference", type=Path, help="bf16 result file (token agreement reference)")
    return p


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def caption(argv: list[str]) -> str:
    machine = f"{platform.machine()} {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}"
    return f"machine: {machine}; command: python -m benchmark.accuracy.run_eval {' '.join(argv)}"


def check_server(url: str, timeout_s: float) -> None:
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s):
                return
        except OSError:
            continue
    raise SystemExit(f"server at {url} does not answer /health or /v1/models within {timeout_s}s")


def evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    if not args.mode or (not args.url and not args.dry_run):
        raise SystemExit("--mode and --url are required to evaluate (or use --compare)")
    counter = load_token_counter(args.tokenizer)
    tasks = parse_task_names(csv_list(str, args.tasks))
    instances = generate_instances(
        tasks, csv_list(int, args.context_lengths), csv_list(int, args.seeds), counter,
        csv_list(float, args.depths), args.num_needles, args.hops,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(instances)} instances; context tokens counted with {counter.method}", flush=True)
    if args.dry_run:
        path = args.out_dir / f"{args.mode}_instances.jsonl"
        with path.open("w") as out:
            for inst in instances:
                out.write(json.dumps({**inst.to_json_dict(), "messages": list(inst.messages)}) + "\n")
        print(f"wrote {path}")
        return 0
    check_server(args.url, min(args.timeout_s, 30.0))
    renderer = counter.apply_chat_template if isinstance(counter, HFTokenCounter) else None
    client = CompletionClient(
        args.url, ApiKind(args.api), args.max_new_tokens, args.timeout_s, args.model, renderer
    )
    results_path = args.out_dir / f"{args.mode}.jsonl"
    with results_path.open("w") as out:

        def write(record: dict) -> None:
            out.write(json.dumps({**record, "chat_render": client.render_method}) + "\n")
            out.flush()
            print(f"{record['instance_id']}: {record['status']} score={record['score']:.2f}", flush=True)

        records = run_instances(client, instances, args.mode, args.concurrency, args.deadline_s, write)
        for record in records:
            if record["status"] in ("not_sent", "timeout") and "run deadline" in record["error"]:
                write(record)
    rows = accuracy_rows(records)
    table = accuracy_table(rows)
    (args.out_dir / f"{args.mode}_accuracy.md").write_text(f"{caption(argv)}\n\n{table}")
    plot_accuracy_vs_context(rows, args.out_dir / f"{args.mode}_accuracy.png", caption(argv))
    print(table)
    return 0


def compare(args: argparse.Namespace, argv: list[str]) -> int:
    if args.reference is None:
        raise SystemExit("--compare needs --reference (the bf16 result file)")
    reference = load_records(args.reference)
    candidates = [record for path in args.compare for record in load_records(path)]
    all_records = reference + [r for r in candidates if r["mode"] != reference[0]["mode"]]
    rows = accuracy_rows(all_records)
    agreement = agreement_rows(reference, candidates)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    head = caption(argv)
    ref_mode = str(reference[0]["mode"])
    (args.out_dir / "comparison_accuracy.md").write_text(f"{head}\n\n{accuracy_table(rows)}")
    (args.out_dir / "comparison_agreement.md").write_text(f"{head}\n\n{agreement_table(agreement, ref_mode)}")
    plot_accuracy_vs_context(rows, args.out_dir / "accuracy_vs_context.png", head)
    print(accuracy_table(rows))
    print(agreement_table(agreement, ref_mode))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return compare(args, argv) if args.compare else evaluate(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
