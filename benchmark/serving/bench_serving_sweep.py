"""SGLang's own ``bench_serving`` against the router of a real PD deployment, per Lynx mode.

For each mode a PD deployment (prefill + decode over Mooncake + sglang_router, default model) is
started with ``--lynx --lynx-config MODE`` (benchmark/pd_modes.py, default overlap scheduler); then,
for each request rate, ``python -m sglang.bench_serving --backend sglang --dataset-name random``
runs against the router with long random inputs (``--random-input-len``, ``--random-range-ratio``),
a bounded ``--num-prompts`` and the local model path as model and tokenizer. The random dataset
samples its token ids from a ShareGPT-format file and would download ShareGPT when ``--dataset-path``
is not a valid JSON file: we write a local one (deterministic English filler,
benchmark/accuracy/filler_text.py) and run with HF offline, so nothing is downloaded.

    python benchmark/serving/bench_serving_sweep.py --modes int8 lynx-int8 lynx \
        --request-rates 0.05 0.2 --num-prompts 4 --input-len 1024 --output-len 32

Writes ``<out>/serving.json`` (provenance, every run's metrics, skipped modes), ``serving.md`` and
``serving.png``, keeps bench_serving's raw JSONL and logs under ``<out>/serving-raw/``. A mode
that fails to start is reported and skipped; every bench_serving run is killed after
``--run-timeout-s`` and the whole sweep stops starting new work after ``--deadline-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.accuracy.filler_text import FillerTextGenerator  # noqa: E402
from benchmark.pd_modes import default_model_path, for_each_mode, run_bounded, stop_on_sigterm  # noqa: E402
from benchmark.provenance import provenance, settings_dict, stamp  # noqa: E402
from benchmark.serving.serving_results import (  # noqa: E402
    failed_run,
    last_run,
    merge_rows,
    plot_sweep,
    sweep_table,
)


def write_local_sharegpt(path: Path, conversations: int = 64, words: int = 400) -> Path:
    """A ShareGPT-format JSON file of deterministic filler conversations (bench_serving's random
    dataset repeats/truncates each human turn's tokens to the sampled input length)."""
    data = []
    for i in range(conversations):
        gen = FillerTextGenerator(seed=1000 + i)
        text: list[str] = []
        while sum(len(s.split()) for s in text) < words:
            text.append(gen.sentence())
        data.append({"id": f"filler-{i}", "conversations": [
            {"from": "human", "value": " ".join(text)}, {"from": "gpt", "value": gen.sentence()}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def bench_serving_argv(url: str, model: str, dataset: Path, rate: float, args: argparse.Namespace,
                       output_file: Path) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--dataset-name", "random", "--dataset-path", str(dataset),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(rate), "--model", model, "--tokenizer", model, "--seed", str(args.seed),
            "--warmup-requests", str(args.warmup_requests), "--ready-check-timeout-sec", "0",
            "--output-file", str(output_file), "--output-details", "--disable-tqdm"]


def sweep_one_mode(mode: str, url: str, model: str, dataset: Path, args: argparse.Namespace,
                   deadline: float) -> list[dict[str, Any]]:
    rows = []
    for rate in args.request_rates:
        left = deadline - time.monotonic()
        if left < 60:
            rows.append(failed_run(mode, rate, args.num_prompts, "not run: sweep deadline reached"))
            continue
        raw = args.out / "serving-raw" / f"{mode}-rate{rate:g}.jsonl"
        raw.unlink(missing_ok=True)
        argv = bench_serving_argv(url, model, dataset, rate, args, raw)
        started = time.monotonic()
        code = run_bounded(argv, min(args.run_timeout_s, left), args.out / "serving-raw" / f"{mode}-rate{rate:g}.log")
        error = "" if code == 0 else ("killed at the run timeout" if code == -9 else f"bench_serving exited {code}")
        row = last_run(raw, mode, rate, args.num_prompts, error)
        row["wall_s"] = round(time.monotonic() - started, 1)
        row["load_1m_after"] = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy it was
        rows.append(row)
        ttft = row["mean_ttft_ms"]
        print(f"[{mode}] rate {rate:g}: {row['completed']} done, TTFT mean "
              f"{'-' if ttft is None else f'{ttft:.0f} ms'}, {row['wall_s']} s {error}", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4", "kivi-int4", "kivi-int2",
                                                  "lynx-int4", "lynx-int8", "lynx"])
    p.add_argument("--request-rates", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=2048, help="bench_serving --random-input-len")
    p.add_argument("--output-len", type=int, default=64, help="bench_serving --random-output-len")
    p.add_argument("--range-ratio", type=float, default=0.8, help="bench_serving --random-range-ratio")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--link", choices=["pacer", "shaped"], default="pacer",
                   help="with --link-gbps: pacer = the application pacer (Lynx streams only; raw unpaced), "
                        "shaped = every prefill behind a tc-shaped veth (all prefill->decode bytes; needs root)")
    p.add_argument("--link-gbps", type=float, default=None, help="the emulated link's rate (none: loopback)")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="bound on one bench_serving run")
    p.add_argument("--deadline-s", type=float, default=4 * 3600.0, help="bound on the whole sweep")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of <out>/serving.json that this run does not redo (same mode and rate); "
                        "their provenance is kept under earlier_provenance")
    return p


def merged_result(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the earlier serving.json's rows that it does not redo, and their provenance."""
    path = out / "serving.json"
    if not path.exists():
        return result
    old = json.loads(path.read_text())
    old_rows = [{**r, "run_utc": r.get("run_utc") or old["provenance"].get("time_utc")} for r in old.get("rows", [])]
    rows = merge_rows(old_rows, result["rows"])
    redone = {r["mode"] for r in result["rows"]}
    skipped = {m: why for m, why in (old.get("skipped_modes") or {}).items() if m not in redone}
    earlier = [*old.get("earlier_provenance", []), old["provenance"]]
    return {**result, "rows": rows, "skipped_modes": {**skipped, **result["skipped_modes"]},
            "earlier_provenance": earlier, "earlier_settings": old.get("settings")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()
    prov = provenance(None if argv is None else [__file__, *argv])
    deadline = time.monotonic() + args.deadline_s
    model = default_model_path()
    dataset = write_local_sharegpt(args.out / "serving-raw" / "local_sharegpt.json")

    def job(mode: str, dep: Any) -> list[dict[str, Any]]:
        rows = sweep_one_mode(mode, dep.url, model, dataset, args, deadline)
        # each mode's rows as soon as they exist: a sweep killed later still leaves them
        (args.out / "serving-raw" / f"{mode}-rows.json").write_text(json.dumps({"provenance": prov, "rows": rows}))
        return rows

    if args.link == "shaped" and args.link_gbps:
        from sglang_lynx.launch.links import open_deployment_link

        with open_deployment_link("shaped", args.link_gbps) as link:
            print(f"[link] {link.describe()}", flush=True)
            runs = for_each_mode(args.modes, job, model_path=model, log_dir=args.out / "serving-raw" / "logs",
                                 start_timeout_s=args.start_timeout_s, link=link)
    else:
        runs = for_each_mode(args.modes, job, model_path=model, log_dir=args.out / "serving-raw" / "logs",
                             start_timeout_s=args.start_timeout_s, link_gbps=args.link_gbps)
    rows = [{**row, "run_utc": prov["time_utc"]} for mode in args.modes for row in runs.results.get(mode, [])]
    prov["machine_end"] = provenance()["machine"]  # load average after the runs, too
    result: dict[str, Any] = {"provenance": prov, "settings": settings_dict(args),
                              "deployment_start_s": runs.start_seconds, "skipped_modes": runs.failures, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        result = merged_result(args.out, result)
        rows = result["rows"]
    (args.out / "serving.json").write_text(json.dumps(result, indent=2))
    table = sweep_table(rows)
    skipped = "".join(f"- {mode} skipped: {why[:300]}\n" for mode, why in result["skipped_modes"].items())
    earlier = "".join(f"- rows from an earlier run: {stamp(p)}\n" for p in result.get("earlier_provenance", []))
    (args.out / "serving.md").write_text(f"{stamp(prov)}\n{earlier}\n{table}\n{skipped}")
    if any(r["completed"] for r in rows):
        plot_sweep(rows, args.out / "serving.png", stamp(prov))
    print(table + skipped)
    return 0 if rows and not runs.failures else 1


if __name__ == "__main__":
    sys.exit(main())
