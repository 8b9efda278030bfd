"""The HTTP clients against a loopback server: chat chunks vs native token counts; an error's answer kept."""

from __future__ import annotations

import json
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_lynx.launch.client import post_json, stream_chat, stream_generate

pytestmark = pytest.mark.timeout(60)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/fails":
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"error": {"message": "sglang-lynx: internal error during verify"}}).encode())
            return
        if self.path == "/generate":  # 1 token, then 3 verified tokens released together, then 1
            events = [{"text": "a", "meta_info": {"completion_tokens": 1}},
                      {"text": "abcd", "meta_info": {"completion_tokens": 4}},
                      {"text": "abcde", "meta_info": {"completion_tokens": 5, "finish_reason": {"type": "length"}}}]
        else:
            events = [{"choices": [{"delta": {"content": "He"}}]}, {"choices": [{"delta": {"content": "llo"}}]},
                      {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def sse_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_native_stream_counts_tokens_not_chunks(sse_url: str) -> None:
    result = stream_generate(sse_url, "x", max_new_tokens=5)
    assert len(result.chunk_times) == 5  # three chunks, five tokens
    assert result.chunk_times[1] == result.chunk_times[3]  # released together
    assert result.text == "abcde" and result.finish_reason == "length"


def test_chat_stream_records_chunks_and_usage(sse_url: str) -> None:
    result = stream_chat(sse_url, [{"role": "user", "content": "hi"}])
    assert result.text == "Hello" and len(result.chunk_times) == 2
    assert result.finish_reason == "stop" and result.usage == {"prompt_tokens": 3}


def test_an_error_status_says_why_and_keeps_the_answer(sse_url: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as failed:
        post_json(f"{sse_url}/fails", {"text": "x"})
    assert failed.value.code == 500
    assert "internal error during verify" in str(failed.value)  # what a CI log shows of a failed request
    assert json.loads(failed.value.read())["error"]["message"].startswith("sglang-lynx:")
