"""Control plane of the Lynx streams: small JSON notices from the sender to the receiver over ZMQ.

The data moves through Mooncake; this channel only says what happened to it:

- ``landed``  ``{"type": "landed", "desc": StreamDescriptor.to_dict()}`` — every chunk of a stream is
  in the receiver's staging memory; the receiver verifies size and crc32 before trusting it;
- ``failed``  ``{"type": "failed", "request_id", "stream", "reason"}`` — the sender gave up on a stream;
- ``quiet``   ``{"type": "quiet", "request_id"}`` — no write of that request can still land.

Lifecycle: the receiver runs a :class:`ControlServer` (a PULL socket bound to the configured host,
never all interfaces unless asked, plus one thread that hands each decoded message to a callback);
the sender keeps one :class:`ControlClient` (PUSH sockets per endpoint, bounded send timeout, no
linger). Malformed messages are counted and dropped, never raised into the receiver.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 10
MESSAGE_TYPES = ("landed", "failed", "quiet")


class ControlMessageError(ValueError):
    """A control message that is not one of ours."""


def decode_message(raw: bytes) -> dict[str, Any]:
    """Parse and check one control message (bounded size, known type, required fields)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"control message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ControlMessageError(f"control message is not JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("type") not in MESSAGE_TYPES:
        raise ControlMessageError(f"control message has no known type: {str(msg)[:200]}")
    required = {"landed": ("desc",), "failed": ("request_id", "stream", "reason"), "quiet": ("request_id",)}
    missing = [k for k in required[msg["type"]] if k not in msg]
    if missing:
        raise ControlMessageError(f"{msg['type']} message lacks {', '.join(missing)}")
    return msg


class ControlServer:
    """Receiver end: binds ``tcp://host:port`` (port 0 = a free one) and calls ``on_message``."""

    def __init__(self, host: str, on_message: Callable[[dict[str, Any]], None], port: int = 0) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self.on_message = on_message
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lynx-control", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(timeout=200)):
                continue
            raw = self._sock.recv()
            try:
                msg = decode_message(raw)
            except ControlMessageError as exc:
                self.dropped += 1
                logger.warning("lynx control: dropped a message: %s", exc)
                continue
            try:
                self.on_message(msg)
            except Exception:  # a handler bug must not kill the control thread
                logger.exception("lynx control: handler failed on %s", msg.get("type"))

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._sock.close(0)


class ControlClient:
    """Sender end: one PUSH socket per receiver endpoint; ``send`` never blocks longer than the timeout."""

    def __init__(self, send_timeout_ms: int = 2000) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._timeout = send_timeout_ms
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._lock = threading.Lock()

    def send(self, endpoint: str, msg: dict[str, Any]) -> bool:
        """Send one message; False (logged) if the receiver is unreachable within the timeout."""
        payload = json.dumps(msg).encode()
        with self._lock:
            sock = self._socks.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self._timeout)
                sock.connect(endpoint)
                self._socks[endpoint] = sock
            try:
                sock.send(payload)
                return True
            except zmq.Again:
                logger.warning("lynx control: %s did not take a %s message in %d ms", endpoint, msg["type"],
                               self._timeout)
                return False

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close(0)
            self._socks.clear()
