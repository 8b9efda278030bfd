"""Does decoding two requests in one batch change stock SGLang PD's greedy output in bf16?

Starts stock SGLang PD (no ``--lynx``), two prefill servers and one decode server (``PDDeployment``, real
Mooncake on loopback), bf16, and sends the xPyD test's first two prompts (``tests/integration/test_xpyd.py``),
each alone, then both at once through different prefills, so the decode server runs them in one batch.
Prints, per repeat and prompt, whether the output equals the one-request output and where it first differs,
and writes ``--out`` (JSON: provenance, the token ids). Why: ``LYNX_XPYD_MODE=lynx-exact`` compares lynx-exact
with a one-request reference, which a batched bf16 decode does not reproduce, Lynx or not.

    OMP_NUM_THREADS=1 python benchmark/decode/batch_composition_pd.py \
        --out benchmark/decode/results/batch_composition_pd-bf16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]

from benchmark.provenance import provenance  # noqa: E402
from test_xpyd import PROMPTS as XPYD_PROMPTS  # noqa: E402

from pd_requests import pd_generate  # noqa: E402
from sglang_lynx.launch.deployment import PDDeployment  # noqa: E402
from sglang_lynx.models.prepare import prepare  # noqa: E402

PROMPTS = XPYD_PROMPTS[:2]  # the xPyD test's two-prefills case sends these two at once
SERVER_ARGS = ["--dtype", "bfloat16", "--max-total-tokens", "4096"]


def _payload(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    alone: list[list[int]] = []
    together: list[list[list[int]]] = []
    with PDDeployment(str(prepare("smollm2-135m")), extra_args=SERVER_ARGS, prefills=2, decodes=1,
                      log_dir=Path(tempfile.gettempdir()) / "lynx-batch-composition-logs") as pd:
        pd.start(timeout_s=600)
        for p in range(2):
            pd_generate(pd, _payload("Hello"), 300, prefill=p)  # warm both pairs
        alone = [pd_generate(pd, _payload(prompt), 600, prefill=i)["output_ids"] for i, prompt in enumerate(PROMPTS)]
        for _ in range(args.repeats):
            with ThreadPoolExecutor(2) as pool:
                together.append(list(pool.map(
                    lambda i: pd_generate(pd, _payload(PROMPTS[i]), 600, prefill=i)["output_ids"], range(2))))
    rows = []
    for rep, got in enumerate(together):
        for i, ids in enumerate(got):
            first = next((k for k, (a, b) in enumerate(zip(alone[i], ids, strict=True)) if a != b), None)
            rows.append({"repeat": rep, "prompt": i, "equal": ids == alone[i], "first_difference": first})
            print(f"repeat {rep} prompt {i}: batched == alone: {ids == alone[i]} (first difference at token {first})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "server_args": SERVER_ARGS, "rows": rows,
                                    "alone": alone, "together": together}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
