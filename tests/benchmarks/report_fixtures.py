"""Small results files shaped like the benchmarks write them, for the report tests."""

from __future__ import annotations

from typing import Any

from benchmark.serving.serving_results import failed_run, parse_run

PROVENANCE: dict[str, Any] = {
    "command": "OMP_NUM_THREADS=1 python benchmark/serving/bench_serving_sweep.py --modes int8",
    "commit": "1234abc",
    "machine": {"platform": "Linux", "arch": "x86_64", "cpu": "AMD EPYC", "nproc": 2, "mem_gib": 23.5,
                "gpu": "none", "python": "3.11.7", "loadavg": [4.2, 3.0, 2.0]},
    "time_utc": "2026-12-01T07:20:00Z",
    "machine_end": {"loadavg": [6.5, 5.0, 3.0]},
}

SERVING_RESULT: dict[str, Any] = {
    "provenance": PROVENANCE,
    "settings": {"num_prompts": 2, "input_len": 1024, "range_ratio": 0.8, "output_len": 32},
    "skipped_modes": {"lynx": "deployment failed to start: decode exited with code 1"},
    "rows": [
        parse_run({"request_rate": 0.1, "completed": 2, "mean_ttft_ms": 1735.9, "mean_tpot_ms": 95.2,
                   "mean_itl_ms": 94.4, "output_throughput": 3.11, "errors": ["", ""], "input_lens": [434, 434]},
                  "int8", 2),
        parse_run({"request_rate": 0.4, "completed": 2, "mean_ttft_ms": 2900.0, "mean_tpot_ms": 120.0,
                   "mean_itl_ms": 118.0, "output_throughput": 4.0, "errors": ["", ""], "input_lens": [434, 434]},
                  "int8", 2),
        failed_run("lynx-int8", 0.1, 2, "killed at the run timeout"),
    ],
}
