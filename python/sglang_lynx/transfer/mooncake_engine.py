"""Typed wrapper over Mooncake's ``TransferEngine`` (P2PHANDSHAKE): the ONLY ``mooncake`` import.

Lifecycle::

    engine = MooncakeEngine.start("127.0.0.1")     # initialize() over TCP; state CREATED -> READY
    engine = MooncakeEngine.start(host, MooncakeTransport("rdma", "mlx5_0"))   # as SGLang's own engine
    engine.register(addr, length)                    # track a registered region
    handle = engine.submit_write(peer, src, dst, n, deadline_s=...)
    status = engine.poll(handle)                     # PENDING / DONE / FAILED / TIMED_OUT
    engine.close()                                   # unregister everything; state -> CLOSED

Invariants and facts (see ../shared/notes/mooncake-tcp.md):

- Every Mooncake return code is checked; a failure raises :class:`MooncakeCallError` naming the call,
  the peer and the code, or (for transfers) is reported as a :class:`WriteStatus` with the code.
- Mooncake does NOT check local source addresses: ``submit_write`` refuses any ``[src, src+n)`` that is
  not inside one region registered through this wrapper (:class:`UnregisteredMemoryError`).
- The protocol and devices are a :class:`MooncakeTransport`; a server takes the ones SGLang's own
  Mooncake engine is configured with (``integration/transport/protocol.py``: RDMA on the
  ``--disaggregation-ib-device`` HCAs, TCP with ``mooncake_tcp`` / ``MC_FORCE_TCP=1``); the default
  is TCP. Memory registered here is host memory (GPU-memory registration is not built).
- ``host`` is what peers use to reach us (never ``0.0.0.0`` unless asked), but the engine's listening
  sockets bind ALL interfaces (0.0.0.0 / [::]) whatever host is given: run it on trusted networks only.
- Environment defaults are set before the import without overriding the user's values:
  ``MC_LOG_LEVEL=ERROR``, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=8192``,
  ``MC_TCP_ADMISSION_TIMEOUT_MS=30000`` (an entry waiting >1 s for admission otherwise fails silently).
  ``MC_LOG_DIR`` aborts the import, so it is refused with a clear error.
- A batch id is freed by Mooncake when it reports done (1) or failed (-1): it is never polled again.
  A transfer past its deadline is reported TIMED_OUT once and kept in an abandoned set;
  :meth:`MooncakeEngine.settled` keeps asking Mooncake about it until it finishes (its id is then
  freed). Until then the bytes of such a transfer may still land in the peer's memory (the receiver
  quarantines the region; the sender keeps the source region, see ``transfer/abandoned.py``).

Thread model: all methods may be called from any thread; region bookkeeping is under a lock. The
sender scheduler calls submit/poll from its one sender thread.
"""

from __future__ import annotations

import bisect
import enum
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

ENV_DEFAULTS: dict[str, str] = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_ADMISSION_TIMEOUT_MS": "30000",
}


class MooncakeUnavailableError(RuntimeError):
    """The mooncake package cannot be imported here (not installed, or libibverbs missing)."""


class MooncakeCallError(RuntimeError):
    """A Mooncake call returned an error code."""

    def __init__(self, call: str, code: int, peer: str | None = None, detail: str = "") -> None:
        self.call, self.code, self.peer = call, code, peer
        where = f" to peer {peer}" if peer else ""
        super().__init__(f"mooncake {call}{where} returned {code}{': ' + detail if detail else ''}")


class UnregisteredMemoryError(ValueError):
    """A local address range is not inside a region registered through this wrapper."""


class EngineState(enum.Enum):
    CREATED = "created"
    READY = "ready"
    CLOSED = "closed"


class WriteStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # Mooncake reported -1 (or another negative code)
    TIMED_OUT = "timed_out"  # our deadline passed (or Mooncake reported -2)


@dataclass(frozen=True)
class MooncakeTransport:
    """What ``TransferEngine.initialize`` is given besides the host: ``protocol`` (``tcp``, ``rdma``,
    ``efa``, ...) and ``device_name`` (comma-separated RDMA devices; "" = Mooncake's own choice)."""

    protocol: str = "tcp"
    device_name: str = ""
    reason: str = "default"  # why this transport (for the start-up log)

    def describe(self) -> str:
        devices = f" on {self.device_name}" if self.device_name else ""
        return f"{self.protocol}{devices} ({self.reason})"


TCP = MooncakeTransport()


@dataclass
class WriteHandle:
    batch_id: int
    peer: str
    length: int
    deadline: float  # time.monotonic() after which the write is reported TIMED_OUT
    code: int = 0  # last code from transfer_check_status
    status: WriteStatus = WriteStatus.PENDING


def apply_env_defaults(environ: Any = None) -> None:
    """Set the Mooncake env defaults that are not already set; refuse MC_LOG_DIR."""
    env = os.environ if environ is None else environ
    if "MC_LOG_DIR" in env:
        raise MooncakeUnavailableError("MC_LOG_DIR is set: it aborts the mooncake import; unset it")
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)


def _import_engine_class() -> Any:
    apply_env_defaults()
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise MooncakeUnavailableError(
            f"cannot import mooncake.engine ({exc}); install mooncake-transfer-engine-non-cuda and the "
            "Debian package libibverbs1"
        ) from exc
    return TransferEngine


def mooncake_available() -> bool:
    try:
        _import_engine_class()
    except MooncakeUnavailableError:
        return False
    return True


class MooncakeEngine:
    """One initialized Mooncake engine with tracked registered regions and checked calls."""

    def __init__(self, host: str, transport: MooncakeTransport = TCP) -> None:
        if host == "0.0.0.0":
            raise ValueError("host 0.0.0.0 is not reachable by peers; pass the address peers should use")
        self.host = host
        self.transport = transport
        self.state = EngineState.CREATED
        self._engine: Any = _import_engine_class()()
        self._lock = threading.Lock()
        self._region_starts: list[int] = []  # sorted
        self._region_lengths: dict[int, int] = {}
        self._abandoned: list[WriteHandle] = []
        self.rpc_port = 0

    @classmethod
    def start(cls, host: str = "127.0.0.1", transport: MooncakeTransport = TCP) -> MooncakeEngine:
        engine = cls(host, transport)
        engine.initialize()
        return engine

    def initialize(self) -> None:
        if self.state is not EngineState.CREATED:
            raise RuntimeError(f"initialize() on an engine in state {self.state.value}")
        t = self.transport
        rc = self._engine.initialize(self.host, "P2PHANDSHAKE", t.protocol, t.device_name)
        if rc != 0:
            raise MooncakeCallError("initialize", rc, detail=f"host {self.host}, P2PHANDSHAKE, {t.describe()}")
        self.rpc_port = int(self._engine.get_rpc_port())
        self.state = EngineState.READY

    @property
    def session_id(self) -> str:
        """What peers pass as ``peer`` to write into this engine's registered memory."""
        self._require_ready("session_id")
        return f"{self.host}:{self.rpc_port}"

    # ----- memory -----
    def register(self, addr: int, length: int) -> None:
        self._require_ready("register")
        if addr <= 0 or length <= 0:
            raise ValueError(f"register: address {addr:#x} and length {length} must be positive")
        with self._lock:
            for start in self._region_starts:
                end = start + self._region_lengths[start]
                if addr < end and start < addr + length:
                    raise ValueError(f"register: [{addr:#x}, +{length}) overlaps region {start:#x}")
            rc = self._engine.register_memory(addr, length)
            if rc != 0:
                raise MooncakeCallError("register_memory", rc, detail=f"{addr:#x}+{length}")
            bisect.insort(self._region_starts, addr)
            self._region_lengths[addr] = length

    @property
    def registered_bytes(self) -> int:
        """Bytes registered through this wrapper (observability: constant while the engine serves)."""
        with self._lock:
            return sum(self._region_lengths.values())

    @property
    def abandoned_writes(self) -> int:
        with self._lock:
            return len(self._abandoned)

    def unregister(self, addr: int) -> None:
        self._require_ready("unregister")
        with self._lock:
            if addr not in self._region_lengths:
                raise UnregisteredMemoryError(f"unregister: {addr:#x} is not a registered region start")
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                raise MooncakeCallError("unregister_memory", rc, detail=f"{addr:#x}")
            self._region_starts.remove(addr)
            del self._region_lengths[addr]

    def check_local(self, addr: int, length: int) -> None:
        """Raise unless ``[addr, addr+length)`` lies inside one registered region."""
        if length <= 0 or addr <= 0:
            raise UnregisteredMemoryError(f"local range {addr:#x}+{length}: address and length must be > 0")
        with self._lock:
            i = bisect.bisect_right(self._region_starts, addr) - 1
            if i >= 0:
                start = self._region_starts[i]
                if addr + length <= start + self._region_lengths[start]:
                    return
        raise UnregisteredMemoryError(
            f"local range {addr:#x}+{length} is not inside a registered region (Mooncake does not check)"
        )

    # ----- transfers -----
    def submit_write(self, peer: str, local_addr: int, remote_addr: int, length: int,
                     deadline_s: float = 60.0) -> WriteHandle:
        """Start an async write of ``length`` bytes to ``peer``'s ``remote_addr``; raise if refused."""
        self._require_ready("submit_write")
        self.check_local(local_addr, length)
        if remote_addr <= 0:
            raise ValueError(f"submit_write to {peer}: remote address {remote_addr:#x} must be > 0")
        batch_id = self._engine.transfer_submit_write(peer, local_addr, remote_addr, length)
        if not batch_id or batch_id < 0:
            raise MooncakeCallError("transfer_submit_write", int(batch_id or 0), peer, f"{length} bytes")
        return WriteHandle(int(batch_id), peer, length, time.monotonic() + deadline_s)

    def poll(self, handle: WriteHandle) -> WriteStatus:
        """Current status; DONE/FAILED/TIMED_OUT are final (the id is never polled again by callers)."""
        if handle.status is not WriteStatus.PENDING:
            return handle.status
        code = int(self._engine.transfer_check_status(handle.batch_id))
        handle.code = code
        if code == 1:
            handle.status = WriteStatus.DONE
        elif code == 0 or code == -2:  # pending past our deadline, or Mooncake's own timeout
            if code == -2 or time.monotonic() > handle.deadline:
                handle.status = WriteStatus.TIMED_OUT
                with self._lock:
                    self._abandoned.append(handle)
        else:
            handle.status = WriteStatus.FAILED
        return handle.status

    def settled(self, handle: WriteHandle) -> bool:
        """True once Mooncake no longer runs ``handle``'s write: reported done or failed, or, for a
        TIMED_OUT (abandoned) write, once Mooncake finally reports it finished."""
        if handle.status is WriteStatus.PENDING:
            return False
        with self._lock:
            if handle not in self._abandoned:
                return True
        code = int(self._engine.transfer_check_status(handle.batch_id))
        if code in (0, -2):
            return False
        handle.code = code
        with self._lock:
            self._abandoned.remove(handle)
        return True

    def forget(self, handle: WriteHandle) -> None:
        """Stop watching an abandoned write that never finished (the caller's hold has passed): it
        leaves ``abandoned_writes``; whoever forgets it counts it."""
        with self._lock:
            if handle in self._abandoned:
                self._abandoned.remove(handle)

    def write_sync(self, peer: str, local_addr: int, remote_addr: int, length: int,
                   deadline_s: float = 60.0, poll_interval_s: float = 0.0005) -> None:
        """Submit + sleep-poll until done; raise :class:`MooncakeCallError` on failure or deadline."""
        handle = self.submit_write(peer, local_addr, remote_addr, length, deadline_s)
        while (status := self.poll(handle)) is WriteStatus.PENDING:
            time.sleep(poll_interval_s)
        if status is not WriteStatus.DONE:
            raise MooncakeCallError("transfer_check_status", handle.code, peer, f"write {status.value}")

    def close(self) -> None:
        """Unregister every region; the engine object itself is released by Mooncake at exit."""
        if self.state is EngineState.CLOSED:
            return
        if self.state is EngineState.READY:
            for start in list(self._region_starts):
                self.unregister(start)
        self.state = EngineState.CLOSED

    def _require_ready(self, call: str) -> None:
        if self.state is not EngineState.READY:
            raise RuntimeError(f"{call}() on a Mooncake engine in state {self.state.value}")
