"""Long-context accuracy per Lynx mode, each through its own real PD deployment (paper Fig. 12).

For each mode a fresh PD deployment (prefill + decode over Mooncake + sglang_router, default
model) is started with ``--lynx --lynx-config MODE`` (SGLang's default overlap scheduler)
(benchmark/pd_modes.py; a fresh deployment per mode, so no mode reads another's radix cache), and
the existing runner ``python -m benchmark.accuracy.run_eval`` is sent to its router. Then every
mode's records are aggregated per (mode, task, context length) with the spread across seeds
(aggregate.py), token agreement against bf16 is computed when bf16 ran, and one accuracy-vs-context
figure with a line per mode is drawn (plot.py).

    python -m benchmark.accuracy.run_modes --modes bf16 lynx-int8 --tasks needle_single \
        --context-lengths 1024 --seeds 0,1 --depths 0.5

Writes ``<out>/<mode>.jsonl`` (the runner's records), ``accuracy_modes.json`` (provenance, rows,
agreement, skipped modes), ``accuracy_modes.md`` and ``accuracy_vs_context.png``. A mode whose
deployment does not start is reported and skipped; each runner call is bounded by
``--deadline-s`` (plus a kill after a grace period).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.accuracy.aggregate import (  # noqa: E402
    AccuracyRow,
    accuracy_rows,
    accuracy_table,
    agreement_rows,
    agreement_table,
    load_records,
)
from benchmark.accuracy.plot import plot_accuracy_vs_context  # noqa: E402
from benchmark.pd_modes import ALL_MODES, ModeRuns, default_model_path, for_each_mode, run_bounded  # noqa: E402
from benchmark.provenance import provenance, settings_dict, stamp  # noqa: E402

REFERENCE_MODE = "bf16"


def runner_argv(url: str, mode: str, model: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "benchmark.accuracy.run_eval", "--url", url, "--api", "native",
            "--mode", mode, "--tasks", args.tasks, "--context-lengths", args.context_lengths,
            "--seeds", args.seeds, "--depths", args.depths, "--max-new-tokens", str(args.max_new_tokens),
            "--concurrency", str(args.concurrency), "--timeout-s", str(args.timeout_s),
            "--deadline-s", str(args.deadline_s), "--tokenizer", model, "--out-dir", str(args.out)]


def summarize(records_by_mode: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Rows per (mode, task, context) with spread across seeds, and agreement with bf16 (pure)."""
    records = [r for mode in records_by_mode for r in records_by_mode[mode]]
    rows = accuracy_rows(records)
    reference = records_by_mode.get(REFERENCE_MODE, [])
    others = [r for mode, recs in records_by_mode.items() if mode != REFERENCE_MODE for r in recs]
    agreement = agreement_rows(reference, others) if reference and others else []
    # lossless check: lynx against the KV it verifies on (lynx-int8), instance by instance
    base, spec = records_by_mode.get("lynx-int8", []), records_by_mode.get("lynx", [])
    lossless = agreement_rows(base, spec) if base and spec else []
    return {"rows": [dataclasses.asdict(r) for r in rows], "agreement": [dataclasses.asdict(a) for a in agreement],
            "lossless": [dataclasses.asdict(a) for a in lossless],
            "accuracy_table": accuracy_table(rows),
            "agreement_table": agreement_table(agreement, REFERENCE_MODE) if agreement else "",
            "lossless_table": agreement_table(lossless, "lynx-int8") if lossless else ""}


def rows_from_json(rows: list[dict[str, Any]]) -> list[AccuracyRow]:
    return [AccuracyRow(**row) for row in rows]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(ALL_MODES))
    p.add_argument("--tasks", default="needle_single,needle_multi,document_qa")
    p.add_argument("--context-lengths", default="1024,2048,4096")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--depths", default="0,0.5,1")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout of the runner")
    p.add_argument("--deadline-s", type=float, default=3600.0, help="bound on one mode's runner call")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--link-gbps", type=float, default=None, help="application pacer for the Lynx streams")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "modes")
    p.add_argument("--merge", action="store_true",
                   help="also aggregate the modes of <out>/accuracy_modes.json that this run does not redo (their "
                        "records are read from <out>/<mode>.jsonl; their provenance is kept under earlier_provenance)")
    p.add_argument("--aggregate-only", action="store_true",
                   help="start nothing: aggregate the <out>/<mode>.jsonl records an earlier (interrupted) run left")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prov = provenance(None if argv is None else ["run_modes", *argv], module="benchmark.accuracy.run_modes")
    model = "" if args.aggregate_only else default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    runner_status: dict[str, int] = {}

    def job(mode: str, dep: Any) -> Path:
        path = args.out / f"{mode}.jsonl"
        path.unlink(missing_ok=True)
        code = run_bounded(runner_argv(dep.url, mode, model, args), args.deadline_s + 120,
                           args.out / "logs" / f"{mode}-runner.log")
        runner_status[mode] = code
        if not path.exists():
            raise RuntimeError(f"the runner wrote no records (exit {code}); see {args.out}/logs/{mode}-runner.log")
        return path

    if args.aggregate_only:
        runs = ModeRuns(results={m: args.out / f"{m}.jsonl" for m in args.modes if (args.out / f"{m}.jsonl").exists()})
        runs.failures = {m: "no records in --aggregate-only" for m in args.modes if m not in runs.results}
    else:
        runs = for_each_mode(args.modes, job, model_path=model, log_dir=args.out / "logs",
                             start_timeout_s=args.start_timeout_s, link_gbps=args.link_gbps)
    records_by_mode = {mode: load_records(path) for mode, path in runs.results.items()}
    mode_run_utc = dict.fromkeys(records_by_mode, prov["time_utc"])
    earlier: dict[str, Any] = {}
    if args.merge and (args.out / "accuracy_modes.json").exists():
        earlier = json.loads((args.out / "accuracy_modes.json").read_text())
        for mode in dict.fromkeys(r["mode"] for r in earlier.get("rows", [])):
            if mode not in records_by_mode and (args.out / f"{mode}.jsonl").exists():
                records_by_mode[mode] = load_records(args.out / f"{mode}.jsonl")
                mode_run_utc[mode] = (earlier.get("mode_run_utc") or {}).get(mode, earlier["provenance"]["time_utc"])
    summary = summarize(records_by_mode)
    prov["machine_end"] = provenance()["machine"]
    result = {"provenance": prov, "settings": settings_dict(args),
              "deployment_start_s": runs.start_seconds, "runner_exit": runner_status,
              "skipped_modes": runs.failures, "rows": summary["rows"], "agreement": summary["agreement"],
              "lossless": summary["lossless"],
              "mode_run_utc": mode_run_utc}
    if earlier:
        result["earlier_provenance"] = [*earlier.get("earlier_provenance", []), earlier["provenance"]]
    (args.out / "accuracy_modes.json").write_text(json.dumps(result, indent=2))
    skipped = "".join(f"- {mode} skipped: {why[:300]}\n" for mode, why in runs.failures.items())
    lossless = f"lynx against lynx-int8 (the KV it verifies on):\n\n{summary['lossless_table']}\n" \
        if summary["lossless_table"] else ""
    text = f"{stamp(prov)}\n\n{summary['accuracy_table']}\n{summary['agreement_table']}\n{lossless}{skipped}"
    (args.out / "accuracy_modes.md").write_text(text)
    if summary["rows"]:
        plot_accuracy_vs_context(rows_from_json(summary["rows"]), args.out / "accuracy_vs_context.png", stamp(prov))
    print(text)
    return 0 if summary["rows"] and not runs.failures else 1


if __name__ == "__main__":
    sys.exit(main())
