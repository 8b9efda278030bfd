"""Mode ``bf16`` through the Lynx transport (identity codec, one stream) in a real PD deployment gives
exactly the completions of a plain single server: every byte reaches the right pool slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx_testlib import start_pd
from sglang_lynx.launch.client import generate

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

PROMPTS = ["The capital of France is", "Write one sentence about the sea:", "def add(a, b):", "List three colours:"]


@pytest.fixture(scope="module")
def pd_lynx_bf16(model_path: str, deployment_logs: Path):
    yield from start_pd(model_path, deployment_logs / "pd-lynx-bf16", "bf16")


def test_bf16_through_lynx_equals_single_server(pd_lynx_bf16, single_server) -> None:
    for prompt in PROMPTS:
        via_lynx = generate(pd_lynx_bf16.url, prompt, max_new_tokens=16)
        alone = generate(single_server.url, prompt, max_new_tokens=16)
        assert via_lynx["output_ids"] == alone["output_ids"], prompt
