"""A small HTTP client for SGLang / router endpoints (stdlib only); the demo (``launch/demo.py``) uses it.

``generate()`` calls the native ``/generate`` API; ``stream_chat()`` calls the OpenAI-compatible
``/v1/chat/completions`` with streaming and records when each chunk arrived, which is how the
demo and the benchmarks measure time to first token. Every call has a timeout.
"""

from __future__ import annotations

import io
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_TOPICS = ("harbour", "orchard", "library", "observatory", "workshop", "market", "railway", "garden")
_VERBS = ("records", "describes", "mentions", "notes", "lists", "explains")
_THINGS = ("the tides", "old ledgers", "copper pipes", "winter apples", "star charts", "timber prices",
           "signal lamps", "river barges", "clock repairs", "seed catalogues")


def haystack(approx_tokens: int, seed: int = 0) -> list[str]:
    """Deterministic filler sentences, about ``approx_tokens`` tokens in all (~12 tokens each)."""
    rng = random.Random(seed)
    sentences = []
    for i in range(max(1, approx_tokens // 12)):
        sentences.append(
            f"Entry {i}: the {rng.choice(_TOPICS)} log {rng.choice(_VERBS)} {rng.choice(_THINGS)} "
            f"and {rng.choice(_THINGS)}."
        )
    return sentences


def needle_prompt(approx_tokens: int, secret: str = "violet-anchor-7351", depth: float = 0.5,
                  seed: int = 0) -> tuple[list[dict[str, str]], str]:
    """A needle-in-a-haystack chat prompt and its expected answer."""
    lines = haystack(approx_tokens, seed)
    lines.insert(int(len(lines) * depth), f"Important: the secret passphrase is {secret}.")
    document = " ".join(lines)
    question = "What is the secret passphrase mentioned in the document? Reply with the passphrase only."
    return [{"role": "user", "content": f"{document}\n\n{question}"}], secret


ERROR_BODY_CHARS = 2000


def post_json(url: str, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST ``payload`` as JSON and return the JSON answer. An error status raises ``HTTPError`` whose
    message carries the server's answer (its first ``ERROR_BODY_CHARS`` characters: why the request
    failed, where a traceback or CI log shows only the exception) and whose ``read()`` still returns it."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        text = body.decode(errors="replace")[:ERROR_BODY_CHARS]
        raise urllib.error.HTTPError(exc.url, exc.code, f"{exc.msg}: {text}", exc.headers, io.BytesIO(body)) from None


def generate(base_url: str, prompt: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
             timeout: float = 180.0, **sampling: Any) -> dict[str, Any]:
    """Native ``/generate``: text or token ids in, the server's JSON out."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    payload = {key: prompt,
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, **sampling}}
    return post_json(f"{base_url}/generate", payload, timeout)


@dataclass
class StreamResult:
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # seconds since the request was sent
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # the last event's meta_info (lynx_* fields too)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


def _sse_events(url: str, payload: dict[str, Any], timeout: float) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST ``payload`` and yield (seconds since sending, event) for every server-sent ``data:`` line."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield time.monotonic() - started, json.loads(data)


def stream_chat(base_url: str, messages: list[dict[str, str]], max_tokens: int = 64,
                temperature: float = 0.0, timeout: float = 300.0) -> StreamResult:
    """Streaming ``/v1/chat/completions``; records the arrival time of every content chunk."""
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult()
    for now, event in _sse_events(f"{base_url}/v1/chat/completions", payload, timeout):
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                result.chunk_times.append(now)
                result.text += piece
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    return result


def stream_generate(base_url: str, text: str, max_new_tokens: int = 64, timeout: float = 300.0,
                    ignore_eos: bool = False) -> StreamResult:
    """Streaming native ``/generate``: ``chunk_times[k-1]`` is when the k-th *token* arrived (a chunk
    may carry several tokens, e.g. verified drafts released together; ``meta_info.completion_tokens``
    says how many so far)."""
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if ignore_eos:
        sampling["ignore_eos"] = True
    payload = {"text": text, "stream": True, "sampling_params": sampling}
    result = StreamResult()
    for now, event in _sse_events(f"{base_url}/generate", payload, timeout):
        meta = event.get("meta_info", {})
        tokens = int(meta.get("completion_tokens", len(result.chunk_times)))
        result.chunk_times.extend([now] * max(0, tokens - len(result.chunk_times)))
        result.text = event.get("text", result.text)
        if meta.get("finish_reason"):
            result.finish_reason = str(meta["finish_reason"].get("type"))
        result.usage = {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": tokens}
        result.meta = meta
    return result
