"""A loopback HTTP server that imitates SGLang's /generate and the OpenAI chat API, for runner tests.

It "answers" a needle question by reading the needle out of the prompt (so a correct pipeline
scores 1), or returns a fixed wrong answer, optionally after a delay; it records the peak number of
requests in flight. Started and stopped by the test fixture; binds 127.0.0.1 on a free port.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeModelState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.requests = 0
        self.delay_s = 0.0
        self.wrong = False

    def answer(self, prompt: str) -> str:
        if self.wrong:
            return "I am not sure, maybe 1000000."
        key = re.search(r"magic numbers? for (\w+) mentioned", prompt)
        if key:
            numbers = re.findall(rf"magic numbers for {key.group(1)} is: (\d+)", prompt)
            return "The numbers are " + ", ".join(numbers) + "."
        return "no idea"


def make_handler(state: FakeModelState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            self._send({"ok": True} if self.path == "/health" else {"data": []})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.in_flight += 1
                state.requests += 1
                state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            time.sleep(state.delay_s)
            reply: dict[str, Any] | None = None
            if self.path == "/generate":
                text = state.answer(body["text"])
                reply = {"text": text, "output_ids": [ord(c) for c in text], "meta_info": {}}
            elif self.path == "/v1/chat/completions":
                text = state.answer(body["messages"][-1]["content"])
                content = [{"token": c, "logprob": 0.0} for c in text]
                message = {"role": "assistant", "content": text}
                reply = {"choices": [{"message": message, "logprobs": {"content": content}}]}
            # Leave the in-flight count before answering: once the client has the reply it may send
            # its next request, which must not be counted as overlapping this one.
            with state.lock:
                state.in_flight -= 1
            try:
                if reply is None:
                    self.send_error(404)
                else:
                    self._send(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _send(self, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class FakeServer:
    def __init__(self) -> None:
        self.state = FakeModelState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
