"""Deployments on loopback: a PD pair behind ``sglang_router``, or a single SGLang server.

Lifecycle: ``start()`` launches every process (each in its own process group, logging to
``log_dir``), waits until all answer their health URL within ``timeout_s`` and raises
``ServerStartError`` (with log tails) as soon as one exits; ``stop()`` takes everything down
(router first, then decode, then prefill) and is idempotent; both classes are context managers.
``PDDeployment.restart_prefill()`` crashes the prefill and starts it again on the same ports (the soak's
peer restart).
Extra SGLang flags (``--lynx``, ``--lynx-config ...``) are forwarded to both servers.

CPU hosts need no extra flags here: the sglang-lynx plugin sets the CPU defaults in every SGLang
process. ``OMP_NUM_THREADS`` defaults to 1 per server on CPU hosts (idle PD schedulers otherwise
fight over the cores).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from sglang_lynx.launch.client import generate
from sglang_lynx.launch.processes import ManagedProcess, ServerStartError, free_port, wait_healthy
from sglang_lynx.platform.host import is_cpu_host


def _server_env() -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if is_cpu_host() and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def default_transfer_backend() -> str:
    return "mooncake_tcp" if is_cpu_host() else "mooncake"


def server_argv(model_path: str, host: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), *extra]


@dataclass
class _Deployment:
    model_path: str
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    processes: list[ManagedProcess] = field(default_factory=list)

    def _logs(self) -> Path:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="lynx-logs-"))
        return self.log_dir

    def _launch(self, timeout_s: float, progress: bool, procs: list[ManagedProcess] | None = None) -> float:
        """Start ``procs`` (default: all) and wait for them; stop everything on failure."""
        procs = self.processes if procs is None else procs
        try:
            for proc in procs:
                proc.start()
            return wait_healthy(procs, timeout_s, progress=progress)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    def alive(self) -> bool:
        return all(p.alive for p in self.processes)

    def __enter__(self):  # noqa: ANN204 - returns the concrete subclass
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class SingleServer(_Deployment):
    """One ordinary SGLang server (the reference a PD deployment must match)."""

    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300.0, progress: bool = False) -> float:
        self.port = self.port or free_port(self.host)
        self.processes = [
            ManagedProcess("server", server_argv(self.model_path, self.host, self.port, self.extra_args),
                           f"{self.url}/health", self._logs() / "server.log", _server_env()),
        ]
        return self._launch(timeout_s, progress)


@dataclass
class PDDeployment(_Deployment):
    """Prefill + decode (Mooncake transport) + ``sglang_router`` in PD mode."""

    transfer_backend: str = field(default_factory=default_transfer_backend)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)  # extra ``sglang_router.launch_router`` flags
    router_port: int = 0
    prefill_port: int = 0
    decode_port: int = 0
    bootstrap_port: int = 0
    metrics_port: int = 0  # the router's Prometheus port (its fixed default collides between routers)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.host}:{self.decode_port}"

    def start(self, timeout_s: float = 300.0, progress: bool = False) -> float:
        for name in ("prefill_port", "decode_port", "bootstrap_port"):
            if not getattr(self, name):
                setattr(self, name, free_port(self.host))
        common = ["--disaggregation-transfer-backend", self.transfer_backend, *self.extra_args]
        prefill = server_argv(self.model_path, self.host, self.prefill_port, [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap_port),
            *common, *self.prefill_args])
        decode = server_argv(self.model_path, self.host, self.decode_port, [
            "--disaggregation-mode", "decode", *common, *self.decode_args])
        logs = self._logs()
        env = _server_env()
        self.processes = [
            ManagedProcess("prefill", prefill, f"{self.prefill_url}/health", logs / "prefill.log", env),
            ManagedProcess("decode", decode, f"{self.decode_url}/health", logs / "decode.log", env),
        ]
        waited = self._launch(timeout_s, progress)
        # The router's ports are picked only now: the servers open many ports of their own while they
        # start (Mooncake's among them), and a port picked earlier may have been taken meanwhile.
        for name in ("router_port", "metrics_port"):
            if not getattr(self, name):
                setattr(self, name, free_port(self.host))
        router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                  "--prefill", self.prefill_url, str(self.bootstrap_port), "--decode", self.decode_url,
                  "--host", self.host, "--port", str(self.router_port),
                  "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port), *self.router_args]
        router_proc = ManagedProcess("router", router, f"{self.url}/health", logs / "router.log", env)
        self.processes.append(router_proc)
        waited += self._launch(max(timeout_s - waited, 30.0), progress, [router_proc])
        try:
            return waited + self._wait_routable(max(timeout_s - waited, 300.0))
        except BaseException:
            self.stop()
            raise

    def process(self, name: str) -> ManagedProcess:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(f"no process {name!r} in this deployment ({[p.name for p in self.processes]})")

    def restart_prefill(self, timeout_s: float = 600.0) -> float:
        """Kill the prefill server's process group (SIGKILL: a crash) and start it again with the same
        command, so on the same HTTP and bootstrap ports, while the decode server and the router keep
        running (the router keeps the prefill's URL; the decode's heartbeat drops the dead prefill's
        bootstrap entry and looks the new one up). Returns the seconds until the new prefill answers
        ``/health``; raises ``ServerStartError`` if it exits or is not healthy within ``timeout_s``
        (the rest of the deployment is left running: ``stop()`` still takes everything down).
        The calling thread must outlive the new prefill: the kernel kills a server when the thread that
        started it exits (see ``processes._die_with_parent``)."""
        prefill = self.process("prefill")
        prefill.kill()
        started = time.monotonic()
        prefill.start()
        wait_healthy([prefill], timeout_s)
        return time.monotonic() - started

    def wait_routable(self, timeout_s: float) -> float:
        """Seconds until a one-token request through the router succeeds (after a restart); raises
        ``ServerStartError`` after ``timeout_s``."""
        return self._wait_routable(timeout_s)

    def _wait_routable(self, timeout_s: float) -> float:
        """The router answers /health before it has discovered its workers: send one-token requests
        through it until one succeeds (bounded)."""
        started = time.monotonic()
        last_error = ""
        while time.monotonic() - started < timeout_s:
            for proc in self.processes:
                proc.check_alive()
            try:
                generate(self.url, "Hello", max_new_tokens=1, timeout=timeout_s)
                return time.monotonic() - started
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last_error = str(exc)
                time.sleep(1.0)
        raise ServerStartError(f"router {self.url} did not route a request within {timeout_s:.0f} s: {last_error}")
