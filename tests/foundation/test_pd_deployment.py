"""A real PD pair (prefill + decode over Mooncake on loopback) behind sglang_router serves the
default model, and its greedy completions equal a single SGLang server's."""

from __future__ import annotations

import pytest

from sglang_lynx.launch.client import generate, needle_prompt, stream_chat

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def pd_plain(raw_pd):
    """Prefill + decode (Mooncake on loopback) + router, without Lynx (shared with the ``lynx-exact`` tests)."""
    return raw_pd


def test_pd_greedy_equals_single_server(pd_plain, single_server) -> None:
    for prompt in PROMPTS:
        via_pd = generate(pd_plain.url, prompt, max_new_tokens=24)
        alone = generate(single_server.url, prompt, max_new_tokens=24)
        assert via_pd["output_ids"] == alone["output_ids"], prompt
        assert len(via_pd["output_ids"]) > 0


def test_pd_long_context_chat_streams(pd_plain) -> None:
    messages, _secret = needle_prompt(1500)
    result = stream_chat(pd_plain.url, messages, max_tokens=16)
    assert result.text.strip()
    assert result.usage.get("prompt_tokens", 0) > 1000
    assert result.ttft is not None and result.chunk_times == sorted(result.chunk_times)


def test_servers_stay_healthy(pd_plain) -> None:
    from sglang_lynx.launch.processes import http_ok

    assert http_ok(f"{pd_plain.prefill_url}/health") and http_ok(f"{pd_plain.decode_url}/health")
    assert pd_plain.alive()
