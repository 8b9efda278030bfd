"""Control plane of the Lynx streams: small JSON notices from the sender to the receiver over ZMQ.

The data moves through Mooncake; this channel only says what happened to it:

- ``landed``  ``{"type": "landed", "desc": StreamDescriptor.to_dict()}`` — every chunk of a stream is
  in the receiver's staging memory; the receiver verifies size and crc32 before trusting it;
- ``failed``  ``{"type": "failed", "request_id", "stream", "reason"}`` — the sender gave up on a stream;
- ``quiet``   ``{"type": "quiet", "request_id"}`` — no write of that request can still land;
- ``accepted`` ``{"type": "accepted", "request_id"}`` — a Lynx prefill took the request (its streams will
  come, or a ``failed`` notice): sent before the prefill reports the request done to SGLang, so a decode
  that sees SGLang's success without it for a while knows the prefill is not a Lynx one;
- ``progress`` ``{"type": "progress", "request_id", "stream", "spans": [[offset, length], ...]}`` — those
  bytes of a stream not landed yet are in place (a part of a request streamed in parts, ``lynx-exact``
  only; at most :data:`MAX_PROGRESS_SPANS` spans per message). Not checked by crc32 until the stream
  lands: a receiver may compute from them ahead, never commit what it computed before the stream lands.

Lifecycle: the receiver runs a :class:`ControlServer` (a PULL socket bound to the configured host,
never all interfaces unless asked, plus one thread that hands each decoded message to a callback);
the sender keeps one :class:`ControlClient` (PUSH sockets per endpoint, bounded send timeout, no
linger). Malformed messages are counted and dropped, never raised into the receiver.

Robustness: the server's thread runs under a :class:`~sglang_lynx.transfer.health.ComponentHealth`
(an error on one message is logged and counted, the thread goes on; a thread that ends while the
server is open makes ``unhealthy_reason()`` say so). The client never holds a lock shared by all peers
across a network send: each peer has its own socket and lock, a send waits at most
``send_timeout_ms``, and a peer that did not take a message is *down* until one is taken: sends to it
are then non-blocking (queued if its socket has room, else failed at once), so one dead decode server
costs the sender thread one timeout, not one per message, and never delays the notices to the others.
Sockets are bounded: beyond ``max_peers`` the least recently used peers idle for ``evict_idle_s`` are
closed (idle, so their notices left long ago: a new socket to the same peer cannot overtake one;
the cap is exceeded for as long as every peer is busy), and a peer down for ``release_after_s`` has
its socket (and the messages queued in it) released.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from sglang_lynx.transfer.health import ComponentHealth

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 10
MESSAGE_TYPES = ("landed", "failed", "quiet", "progress", "accepted")
MAX_PROGRESS_SPANS = 1024


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
    required = {"landed": ("desc",), "failed": ("request_id", "stream", "reason"), "quiet": ("request_id",),
                "progress": ("request_id", "stream", "spans"), "accepted": ("request_id",)}
    missing = [k for k in required[msg["type"]] if k not in msg]
    if missing:
        raise ControlMessageError(f"{msg['type']} message lacks {', '.join(missing)}")
    if msg["type"] == "progress":
        msg["spans"] = progress_spans(msg["spans"])
    return msg


def progress_spans(spans: object) -> list[tuple[int, int]]:
    """A progress message's spans: at most :data:`MAX_PROGRESS_SPANS` ``[offset, length]`` pairs of
    non-negative integers, lengths >= 1 (:class:`ControlMessageError` otherwise)."""
    if not isinstance(spans, list) or not 0 < len(spans) <= MAX_PROGRESS_SPANS:
        raise ControlMessageError(f"progress spans must be a list of 1 to {MAX_PROGRESS_SPANS} pairs")
    out = []
    for span in spans:
        if (not isinstance(span, list) or len(span) != 2 or any(type(v) is not int for v in span)
                or span[0] < 0 or span[1] < 1 or span[0] + span[1] > 1 << 62):
            raise ControlMessageError(f"progress span {str(span)[:60]} is not [offset >= 0, length >= 1]")
        out.append((span[0], span[1]))
    return out


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
        self.health = ComponentHealth("control server")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.health.thread("lynx-control", self._loop, self._stop.is_set),
                                        name="lynx-control", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._receive_one(poller)
                self.health.ok()
            except Exception as exc:  # a socket or handler error must not kill the control thread
                self.health.record("thread", exc)
                self._stop.wait(0.01)  # an error that repeats at once must not spin

    def _receive_one(self, poller: zmq.Poller) -> None:
        if not dict(poller.poll(timeout=200)):
            return
        raw = self._sock.recv()
        try:
            msg = decode_message(raw)
        except ControlMessageError as exc:
            self.dropped += 1
            logger.warning("lynx control: dropped a message: %s", exc)
            return
        self.on_message(msg)

    def unhealthy_reason(self) -> str | None:
        return self.health.unhealthy_reason()

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._sock.close(0)


@dataclass
class _Peer:
    sock: zmq.Socket[bytes]
    lock: threading.Lock
    down_since: float = 0.0  # 0: up; else when it first failed to take a message (sends never block then)
    closed: bool = False
    retired: bool = False  # evicted while a send was using it: closed when that send ends
    last_used: float = 0.0  # when a send last started or ended


class ControlClient:
    """Sender end: one PUSH socket per receiver endpoint; ``send`` never blocks longer than the timeout."""

    def __init__(self, send_timeout_ms: int = 2000, max_peers: int = 64, release_after_s: float = 60.0,
                 send_hwm: int = 1000, evict_idle_s: float = 1.0) -> None:
        if send_timeout_ms < 1 or max_peers < 1 or not release_after_s > 0 or send_hwm < 1 or not evict_idle_s > 0:
            raise ValueError("ControlClient: send_timeout_ms, max_peers, send_hwm must be >= 1 and "
                             f"release_after_s ({release_after_s}), evict_idle_s ({evict_idle_s}) > 0")
        self.evict_idle_s = evict_idle_s
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._timeout, self._hwm = send_timeout_ms, send_hwm
        self.max_peers, self.release_after_s = max_peers, release_after_s
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # guards _peers only: never held across a send
        self.failed_sends = 0

    def send(self, endpoint: str, msg: dict[str, Any]) -> bool:
        """Send one message; False (logged) if the receiver is unreachable within the timeout or down."""
        payload = json.dumps(msg).encode()
        for _ in range(3):  # a peer closed (evicted) between lookup and lock is looked up again
            peer = self._peer(endpoint)
            with peer.lock:
                if peer.closed:
                    continue
                peer.last_used = time.monotonic()
                sent = self._send_locked(endpoint, peer, payload, str(msg.get("type")))
                peer.last_used = time.monotonic()
            if peer.retired:
                self._close_retired(endpoint, peer)
            return sent
        return False

    def _close_retired(self, endpoint: str, peer: _Peer) -> None:
        """Close an evicted peer unless a send is using it (that send closes it when it ends)."""
        if peer.lock.acquire(blocking=False):
            try:
                self._close_locked(endpoint, peer)
            finally:
                peer.lock.release()

    def _send_locked(self, endpoint: str, peer: _Peer, payload: bytes, kind: str) -> bool:
        now = time.monotonic()
        down = peer.down_since > 0
        try:
            peer.sock.send(payload, zmq.NOBLOCK if down else 0)
        except zmq.ZMQError as exc:
            self.failed_sends += 1
            if not down:
                peer.down_since = now
                logger.warning("lynx control: %s did not take a %s message in %d ms (%s); it is down: sends to it "
                               "do not wait until it takes one again", endpoint, kind, self._timeout, exc)
            if now - peer.down_since >= self.release_after_s:
                logger.warning("lynx control: %s down for %.0f s: its socket is released", endpoint,
                               now - peer.down_since)
                self._close_locked(endpoint, peer)
            return False
        if down:
            logger.info("lynx control: %s takes messages again", endpoint)
        peer.down_since = 0.0
        return True

    def _peer(self, endpoint: str) -> _Peer:
        evicted: list[tuple[str, _Peer]] = []
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is not None:
                self._peers.move_to_end(endpoint)
            else:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self._timeout)
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                sock.connect(endpoint)
                peer = self._peers[endpoint] = _Peer(sock, threading.Lock(), last_used=time.monotonic())
            excess, now = len(self._peers) - self.max_peers, time.monotonic()
            for name, old in list(self._peers.items()) if excess > 0 else []:
                if len(evicted) >= excess:
                    break
                if name != endpoint and now - old.last_used > self.evict_idle_s:
                    del self._peers[name]
                    evicted.append((name, old))
        for name, old in evicted:  # least recently used over the cap: closed once no send is using it
            old.retired = True
            self._close_retired(name, old)
        return peer

    def _close_locked(self, endpoint: str, peer: _Peer) -> None:
        if not peer.closed:
            peer.closed = True
            # an evicted live peer keeps its queued notices for one send timeout; a gone one drops them
            peer.sock.close(self._timeout if peer.retired and not peer.down_since else 0)
        with self._lock:
            if self._peers.get(endpoint) is peer:
                del self._peers[endpoint]

    def release(self, endpoint: str) -> None:
        """The peer is gone: close its socket (dropping what is queued for it)."""
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None:
            with peer.lock:
                self._close_locked(endpoint, peer)

    def peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers.items())
        for endpoint, peer in peers:
            with peer.lock:
                self._close_locked(endpoint, peer)
