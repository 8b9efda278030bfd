"""The decode server's pace per mode: does the Lynx plugin slow SGLang's decode steps down?

One command::

    OMP_NUM_THREADS=1 python benchmark/serving/decode_pace.py --modes raw int8 lynx bf16 --requests 5

Per mode, one PD deployment on loopback (no link emulation: every stream lands within milliseconds, so
``lynx`` drafts nothing and its requests decode as plain ones), one warm-up request, then ``--requests``
1.4K-token needle prompts one after another (the TTkT benchmark's prompts), ``--max-tokens`` greedy tokens each
(EOS ignored). The pace of a request is the median gap between its streamed tokens from token 40 on (past the
first token and any verify). ``raw`` is stock SGLang PD (no ``--lynx``). The modes run one after another on a
shared VM, so compare them against the spread of ``raw``'s own requests. Writes ``--out`` (JSON: command, commit,
machine, per-request paces in ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "python"))

from benchmark.pd_modes import mode_server_args, stop_on_sigterm  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from benchmark.serving.bench_ttkt import ROUTER_ARGS, _prompt, _request  # noqa: E402

from sglang_lynx.launch.deployment import PDDeployment  # noqa: E402
from sglang_lynx.models.prepare import prepare  # noqa: E402

FROM_TOKEN = 40


def pace_ms(times: list[float]) -> float:
    """Median gap between streamed tokens from token ``FROM_TOKEN`` on, in ms."""
    gaps = [b - a for a, b in zip(times[FROM_TOKEN:-1], times[FROM_TOKEN + 1:], strict=True)]
    return 1e3 * statistics.median(gaps)


def run_mode(model: str, mode: str, args: argparse.Namespace, tokenizer: Any, run: int) -> list[float]:
    extra = mode_server_args(mode, ["--max-total-tokens", "8192"])
    dep = PDDeployment(model, extra_args=extra, log_dir=args.out.parent / "logs" / f"{run}-{mode}",
                       router_args=ROUTER_ARGS)  # fmt: skip
    paces = []
    with dep:
        dep.start(timeout_s=900)
        _request(dep.url, _prompt(tokenizer, args.context_tokens, 100)[0], 8)  # warm-up
        for seed in range(args.requests):
            res, error = _request(dep.url, _prompt(tokenizer, args.context_tokens, seed)[0], args.max_tokens)
            if error:
                raise RuntimeError(f"{mode}, prompt {seed}: {error}")
            paces.append(pace_ms(res.chunk_times))
            print(f"[{mode}] prompt {seed}: {paces[-1]:.1f} ms per token", flush=True)
    return paces


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["raw", "int8", "lynx", "bf16"])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=Path("benchmark/serving/results/decode-pace/decode_pace.json"))
    args = parser.parse_args()
    stop_on_sigterm()
    if args.max_tokens < FROM_TOKEN + 8:
        parser.error(f"--max-tokens must be >= {FROM_TOKEN + 8}")
    model = str(prepare("smollm2-135m"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    runs = []  # in run order; a mode named twice (e.g. raw first and last) brackets the VM's drift
    for i, mode in enumerate(args.modes):
        runs.append({"mode": mode, "run": i, "paces_ms": run_mode(model, mode, args, tokenizer, i)})
    print("| run | mode | pace per prompt (ms per token) | median |\n|---|---|---|---|")
    for run in runs:
        values = run["paces_ms"]
        listed = " ".join(f"{v:.1f}" for v in values)
        print(f"| {run['run']} | {run['mode']} | {listed} | {statistics.median(values):.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "from_token": FROM_TOKEN, "runs": runs},
                                   indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
