"""Time to first token of the first requests a fresh ``lynx`` PD deployment serves (issue: built at install).

Starts the README's deployment (prefill + decode + router, ``--lynx --lynx-config lynx``), sends the
demo's ~2K-token needle request ``--requests`` times in a row and records each TTFT; the first minus
the later ones is what a fresh server pays on its first request. ``--kernel-cache`` points the C fast
path's cache (``LYNX_KERNEL_CACHE``) at a directory: an empty one reproduces a fresh clone (before the
set-up built the library, the first request compiled it; now the server loads what the set-up built, or
logs the torch reference). The code measured is whatever ``sglang_lynx`` imports (``PYTHONPATH`` can
point at another checkout: its path is recorded). Appends one JSON line per run to ``--out``.

    python benchmark/serving/first_request.py --kernel-cache /tmp/kc --label after \
        --out benchmark/serving/results/first_request.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.provenance import git_commit, provenance  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-cache", type=Path, required=True, help="LYNX_KERNEL_CACHE for the servers")
    parser.add_argument("--label", required=True, help="a name for this run (e.g. before / after)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    os.environ["LYNX_KERNEL_CACHE"] = str(args.kernel_cache)
    import sglang_lynx
    from sglang_lynx.launch.client import needle_prompt, stream_chat
    from sglang_lynx.launch.deployment import PDDeployment
    from sglang_lynx.models.catalog import DEFAULT_MODEL, model_dir

    cache_before = sorted(p.name for p in args.kernel_cache.glob("*.so")) if args.kernel_cache.exists() else []
    extra = ["--lynx", "--lynx-config", "lynx"]
    code = Path(sglang_lynx.__file__).parent
    record: dict = {"label": args.label, "code": str(code), "code_commit": git_commit(code),
                    "kernel_cache_at_start": cache_before, "ttft_s": [], "found": []}
    with PDDeployment(str(model_dir(DEFAULT_MODEL)), extra_args=extra,
                      log_dir=Path(tempfile.mkdtemp(prefix="lynx-first-"))) as deployment:
        record["start_s"] = round(deployment.start(timeout_s=args.timeout), 1)
        for _ in range(args.requests):
            messages, secret = needle_prompt(args.context_tokens)
            result = stream_chat(deployment.url, messages, max_tokens=32)
            record["ttft_s"].append(None if result.ttft is None else round(result.ttft, 3))
            record["found"].append(secret in result.text)
    record["kernel_cache_at_end"] = sorted(p.name for p in args.kernel_cache.glob("*.so"))
    record["load_average"] = os.getloadavg()
    record["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    record["provenance"] = provenance()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")
    print(json.dumps({k: record[k] for k in ("label", "ttft_s", "start_s", "kernel_cache_at_start",
                                             "kernel_cache_at_end", "load_average")}))
    return 0 if all(record["found"]) else 1


if __name__ == "__main__":
    sys.exit(main())
