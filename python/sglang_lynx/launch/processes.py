"""Managed server processes: start with a log file, wait for health, stop the whole process group.

Invariants: every wait is bounded; a process that exits while we wait for it turns into a
``ServerStartError`` quoting the tail of its log; ``stop()`` is idempotent and escalates from
SIGINT to SIGTERM to SIGKILL within ``grace_s`` so no child (SGLang's scheduler and detokenizer
subprocesses included) outlives its deployment; ``kill()`` is the crash (SIGKILL to the group at
once), after which ``start()`` launches the same command again.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGKILL this server if the launcher dies (no orphaned servers after a crash or kill -9).

    The signal fires when the *thread* that started the server exits (PR_SET_PDEATHSIG follows the
    forking thread, not the process): start a server from a thread that lives as long as it should."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerStartError(RuntimeError):
    """A server exited or did not become healthy in time."""


#: Ports the launcher hands out: below Linux's ephemeral range (32768-60999 by default), where
#: SGLang's ZMQ sockets and outgoing connections take theirs, and above Mooncake's (15000-24000
#: seen here). A port picked from the ephemeral range was taken by another process's ZMQ socket
#: between the pick and the server's bind (seen with three deployments on one host).
LAUNCH_PORT_RANGE = (26000, 32000)
START_POLL_S = 0.25  # how often a start-up wait asks again (a local health URL: cheap; each deployment waits 3 times)


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port in :data:`LAUNCH_PORT_RANGE` that is free on ``host`` right now (an ephemeral port
    if none of ``tries`` random picks is)."""
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(*LAUNCH_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout: float = 10.0) -> bool:
    """True if ``url`` answers 2xx; False for any failure, including a non-HTTP peer on the port."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ManagedProcess:
    """One server process (in its own process group) with a log file and a health URL."""

    name: str
    argv: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def healthy(self) -> bool:
        return self.alive and http_ok(self.health_url)

    def check_alive(self) -> None:
        if not self.alive:
            code = None if self.popen is None else self.popen.returncode
            raise ServerStartError(
                f"{self.name} exited with code {code}; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
            )

    def kill(self, wait_s: float = 30.0) -> None:
        """SIGKILL the whole process group at once (a crash, not a shutdown) and reap the leader; the
        process can then be started again with :meth:`start` (same argv, so the same ports)."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=wait_s)

    def stop(self, grace_s: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        pgid = self.popen.pid
        for sig, share in ((signal.SIGINT, 0.4), (signal.SIGTERM, 0.4), (signal.SIGKILL, 0.2)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=max(grace_s * share, 0.5))
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(pgid, signal.SIGKILL)


def wait_healthy(procs: list[ManagedProcess], timeout_s: float, *, progress: bool = False) -> float:
    """Wait until every process answers its health URL; return seconds waited.

    Raises ServerStartError as soon as one exits, or when ``timeout_s`` passes.
    """
    started = time.monotonic()
    pending = list(procs)
    last_line = ""
    while pending:
        for proc in list(pending):
            proc.check_alive()
            if proc.healthy():
                pending.remove(proc)
        elapsed = time.monotonic() - started
        if progress:
            ready = [p.name for p in procs if p not in pending]
            waiting = ", ".join(p.name for p in pending) or "-"
            line = f"\r[lynx] {elapsed:5.0f}s  up: {', '.join(ready) or '-'}  waiting: {waiting}"
            if line != last_line:
                print(line.ljust(100), end="", flush=True)
                last_line = line
        if not pending:
            break
        if elapsed > timeout_s:
            names = ", ".join(p.name for p in pending)
            tails = "\n".join(f"--- {p.name} ({p.log_path}):\n{log_tail(p.log_path, 15)}" for p in pending)
            raise ServerStartError(f"not healthy after {timeout_s:.0f} s: {names}\n{tails}")
        time.sleep(START_POLL_S)
    if progress:
        print()
    return time.monotonic() - started
