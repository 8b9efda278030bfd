"""Greedy completions over HTTP from a running server (SGLang native `/generate` or OpenAI chat).

Lifecycle: `CompletionClient(url, api, ...)` is built once per run and is thread-safe (it keeps no
per-request state); `complete(instance)` sends one request with a bounded socket timeout and
returns a `Completion` whose `status` says what happened — it never raises for a network or server
failure, so one bad request loses nothing else. Payload builders and response parsers are pure
functions. Native `/generate` needs the chat already rendered to text: the local HF tokenizer's
chat template when available, else ChatML (the template SmolLM2-Instruct uses); `render_method`
says which. Output tokens: ids from `/generate` (`output_ids`), token strings from the OpenAI
API (`logprobs`), so token agreement is computed on like with like within one API.
"""

from __future__ import annotations

import enum
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmark.accuracy.task_types import Message, TaskInstance


class ApiKind(str, enum.Enum):
    NATIVE = "native"
    OPENAI = "openai"


class RequestStatus(str, enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    HTTP_ERROR = "http_error"
    CONNECTION_ERROR = "connection_error"
    BAD_RESPONSE = "bad_response"
    NOT_SENT = "not_sent"


@dataclass(frozen=True)
class Completion:
    status: RequestStatus
    text: str = ""
    tokens: list[int | str] = field(default_factory=list)
    token_kind: str = "none"
    latency_s: float = 0.0
    error: str = ""


def render_chatml(messages: Sequence[Message]) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def native_payload(prompt_text: str, max_new_tokens: int) -> dict[str, Any]:
    return {
        "text": prompt_text,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
    }


def openai_payload(messages: Sequence[Message], max_new_tokens: int, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": list(messages),
        "temperature": 0.0,
        "max_tokens": max_new_tokens,
        "logprobs": True,
    }


def parse_native(body: Any) -> tuple[str, list[int | str], str]:
    if isinstance(body, list):
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ValueError(f"no 'text' in /generate response: {str(body)[:200]}")
    ids = body.get("output_ids")
    tokens: list[int | str] = [int(t) for t in ids] if isinstance(ids, list) else []
    return body["text"], tokens, "ids" if isinstance(ids, list) else "none"


def parse_openai(body: Any) -> tuple[str, list[int | str], str]:
    try:
        choice = body["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"no choices[0].message.content in response: {str(body)[:200]}") from exc
    content = (choice.get("logprobs") or {}).get("content")
    if isinstance(content, list):
        return text, [str(item["token"]) for item in content], "strings"
    return text, [], "none"


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> Any:
    data = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read().decode())


class CompletionClient:
    def __init__(
        self,
        base_url: str,
        api: ApiKind,
        max_new_tokens: int,
        timeout_s: float,
        model: str = "default",
        chat_renderer: Callable[[list[Message]], str] | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.max_new_tokens = max_new_tokens
        self.timeout_s = timeout_s
        self.model = model
        self._render = chat_renderer or render_chatml
        self.render_method = "hf-chat-template" if chat_renderer else "chatml"

    def endpoint(self) -> str:
        suffix = "/generate" if self.api is ApiKind.NATIVE else "/v1/chat/completions"
        return self.base_url + suffix

    def payload(self, instance: TaskInstance) -> dict[str, Any]:
        if self.api is ApiKind.NATIVE:
            return native_payload(self._render(list(instance.messages)), self.max_new_tokens)
        return openai_payload(instance.messages, self.max_new_tokens, self.model)

    def complete(self, instance: TaskInstance) -> Completion:
        start = time.monotonic()
        try:
            body = post_json(self.endpoint(), self.payload(instance), self.timeout_s)
            parse = parse_native if self.api is ApiKind.NATIVE else parse_openai
            text, tokens, kind = parse(body)
            return Completion(RequestStatus.OK, text, tokens, kind, time.monotonic() - start)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            return self._failed(RequestStatus.HTTP_ERROR, f"HTTP {exc.code}: {detail}", start)
        except TimeoutError as exc:
            return self._failed(RequestStatus.TIMEOUT, f"no answer within {self.timeout_s}s: {exc}", start)
        except urllib.error.URLError as exc:
            status = RequestStatus.TIMEOUT if isinstance(exc.reason, TimeoutError) else None
            return self._failed(status or RequestStatus.CONNECTION_ERROR, str(exc.reason), start)
        except (ValueError, json.JSONDecodeError) as exc:
            return self._failed(RequestStatus.BAD_RESPONSE, str(exc), start)
        except OSError as exc:
            return self._failed(RequestStatus.CONNECTION_ERROR, f"{type(exc).__name__}: {exc}", start)

    @staticmethod
    def _failed(status: RequestStatus, error: str, start: float) -> Completion:
        return Completion(status, latency_s=time.monotonic() - start, error=error)
