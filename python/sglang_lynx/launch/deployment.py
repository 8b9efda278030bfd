"""Deployments on loopback: PD servers (1P1D by default, or xPyD) behind ``sglang_router``, or a
single SGLang server.

Lifecycle: ``start()`` launches every process (each in its own process group, logging to
``log_dir``), waits until all answer their health URL within ``timeout_s`` and raises
``ServerStartError`` (with log tails) as soon as one exits; ``stop()`` takes everything down
(router first, then the decode servers, then the prefill servers) and is idempotent; both classes are context managers.
Extra SGLang flags (``--lynx``, ``--lynx-config ...``) are forwarded to every server.
A :class:`Placement` per role says where a PD deployment's prefill or decode servers run: the
address they bind and advertise, a command prefix (``ip netns exec NS``) and extra environment;
``launch/shaped.py`` places the prefills in a network namespace behind a shaped veth.

CPU hosts need no extra flags here: the sglang-lynx plugin sets the CPU defaults in every SGLang
process. ``OMP_NUM_THREADS`` defaults to 1 per server on CPU hosts (idle PD schedulers otherwise
fight over the cores). On a CUDA host every server gets its own GPUs (``--base-gpu-id``, contiguous
tensor-parallel ranges, ``--mem-fraction-static`` where asked for or where servers must share a GPU:
``launch.gpus``); not run on a GPU host yet.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sglang_lynx.launch.client import generate
from sglang_lynx.launch.gpus import Placement as GpuPlacement
from sglang_lynx.launch.gpus import check_not_owned, place_servers, tp_size_of, visible_gpus
from sglang_lynx.launch.processes import START_POLL_S, ManagedProcess, ServerStartError, free_port, wait_healthy
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


# The router's health check waits 5 s by default, while a busy SGLang server may take up to its own
# SGLANG_HEALTH_CHECK_TIMEOUT (20 s) to answer /health (a health generate answered at the next batch
# result); on a loaded CPU host the router then dropped a working decode server (the soak, 2026-12-02).
ROUTER_HEALTH_TIMEOUT_S = 30
#: The module the router runs as: ``sglang_router.launch_router``'s Rust router without that module's
#: import of ``sglang`` (5 s of a deployment's start on an idle 2-core host, 15 s beside a test tier).
ROUTER_ENTRY = "sglang_lynx.integration.platform.router_process"


@dataclass
class Placement:
    """Where one role's servers run: ``host`` (bound with ``--host`` and reached there by the router
    and the other role), ``prefix`` (put before the server's argv, e.g. ``ip netns exec NS``) and
    ``env`` (added to the server's environment)."""

    host: str
    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class _Deployment:
    model_path: str
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    processes: list[ManagedProcess] = field(default_factory=list)
    base_gpu_id: int = 0  # CUDA hosts: the first server's first GPU (``launch.gpus``)
    mem_fraction: float | None = None  # CUDA hosts: --mem-fraction-static of every server (None: SGLang's)
    gpus: int | None = None  # CUDA hosts: GPUs to place on (None: detected, ``gpus.visible_gpus``)
    placements: list[GpuPlacement] = field(default_factory=list)

    def _place(self, names: list[str], per_server_args: list[list[str]]) -> list[list[str]]:
        """Each server's GPU flags (empty lists on a CPU host)."""
        if is_cpu_host():
            self.placements = []
            return [[] for _ in names]
        for args in [self.extra_args, *per_server_args]:
            check_not_owned(args)
        tp = max(tp_size_of([*self.extra_args, *args]) for args in per_server_args)
        gpus = visible_gpus() if self.gpus is None else self.gpus
        self.placements = place_servers(names, tp, gpus, self.base_gpu_id, self.mem_fraction)
        return [p.argv() for p in self.placements]

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
        self.processes = self.server_processes()
        return self._launch(timeout_s, progress)

    def server_processes(self) -> list[ManagedProcess]:
        self.port = self.port or free_port(self.host)
        (gpu_args,) = self._place(["server"], [[]])
        argv = server_argv(self.model_path, self.host, self.port, [*self.extra_args, *gpu_args])
        return [ManagedProcess("server", argv, f"{self.url}/health", self._logs() / "server.log", _server_env())]


@dataclass
class PDDeployment(_Deployment):
    """``prefills`` prefill + ``decodes`` decode servers (Mooncake transport) + ``sglang_router`` in PD
    mode (default 1P1D). Each server has its own HTTP port, each prefill its own bootstrap port; the
    router is given every prefill (with its bootstrap port) and every decode. ``prefill_port``,
    ``decode_port``, ``bootstrap_port`` (and the ``*_url`` properties) name the first of each; the
    processes are named ``prefill``/``decode`` in 1P1D, ``prefill0``, ``prefill1``, ... otherwise."""

    transfer_backend: str = field(default_factory=default_transfer_backend)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)  # extra router flags (``sglang_router.launch_router``'s)
    router_port: int = 0
    prefill_port: int = 0
    decode_port: int = 0
    bootstrap_port: int = 0
    metrics_port: int = 0  # the router's Prometheus port (its fixed default collides between routers)
    prefills: int = 1
    decodes: int = 1
    prefill_ports: list[int] = field(default_factory=list)
    decode_ports: list[int] = field(default_factory=list)
    bootstrap_ports: list[int] = field(default_factory=list)
    prefill_place: Placement | None = None  # None: on this host at ``host`` (the router's address)
    decode_place: Placement | None = None

    def __post_init__(self) -> None:
        for name in ("prefills", "decodes"):
            count = getattr(self, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"PDDeployment: {name} must be an int >= 1, got {count!r}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    def place(self, role: str) -> Placement:
        """The placement of ``role`` (``prefill`` or ``decode``): the given one or this host."""
        given = self.prefill_place if role == "prefill" else self.decode_place
        return given or Placement(self.host)

    @property
    def prefill_url(self) -> str:
        return f"http://{self.place('prefill').host}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.place('decode').host}:{self.decode_port}"

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{self.place('prefill').host}:{port}" for port in self.prefill_ports]

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{self.place('decode').host}:{port}" for port in self.decode_ports]

    def _ports(self, first: int, existing: list[int], count: int, taken: set[int], role: str) -> list[int]:
        """``count`` distinct free ports: ``existing`` again on a restart, else ``first`` (if set) and
        fresh ones (free on the role's address; in a fresh namespace, free on the router's)."""
        place = self.place(role)
        probe = self.host if place.prefix else place.host
        ports = list(existing) if len(existing) == count and existing[0] == first else ([first] if first else [])
        while len(ports) < count:
            port = free_port(probe)
            if port not in taken and port not in ports:
                ports.append(port)
        taken.update(ports)
        return ports

    def _name(self, role: str, index: int) -> str:
        return role if getattr(self, f"{role}s") == 1 else f"{role}{index}"

    def server_processes(self) -> list[ManagedProcess]:
        """Pick the servers' ports (kept on a restart) and build every prefill and decode process."""
        taken: set[int] = set()
        self.prefill_ports = self._ports(self.prefill_port, self.prefill_ports, self.prefills, taken, "prefill")
        self.bootstrap_ports = self._ports(self.bootstrap_port, self.bootstrap_ports, self.prefills, taken, "prefill")
        self.decode_ports = self._ports(self.decode_port, self.decode_ports, self.decodes, taken, "decode")
        self.prefill_port, self.bootstrap_port = self.prefill_ports[0], self.bootstrap_ports[0]
        self.decode_port = self.decode_ports[0]
        common = ["--disaggregation-transfer-backend", self.transfer_backend, *self.extra_args]
        logs = self._logs()
        pre, dec = self.place("prefill"), self.place("decode")
        names = [self._name("prefill", i) for i in range(self.prefills)] + [
            self._name("decode", i) for i in range(self.decodes)]
        gpu_args = self._place(names, [self.prefill_args] * self.prefills + [self.decode_args] * self.decodes)
        procs = []
        for i, (port, bootstrap) in enumerate(zip(self.prefill_ports, self.bootstrap_ports, strict=True)):
            argv = pre.prefix + server_argv(self.model_path, pre.host, port, [
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
                *common, *self.prefill_args, *gpu_args[i]])
            name = self._name("prefill", i)
            procs.append(ManagedProcess(name, argv, f"{self.prefill_urls[i]}/health", logs / f"{name}.log",
                                        {**_server_env(), **pre.env}))
        for i, port in enumerate(self.decode_ports):
            argv = dec.prefix + server_argv(self.model_path, dec.host, port, [
                "--disaggregation-mode", "decode", *common, *self.decode_args, *gpu_args[self.prefills + i]])
            name = self._name("decode", i)
            procs.append(ManagedProcess(name, argv, f"{self.decode_urls[i]}/health", logs / f"{name}.log",
                                        {**_server_env(), **dec.env}))
        return procs

    def router_argv(self) -> list[str]:
        """``sglang_router`` in PD mode with every prefill (URL and bootstrap port) and every decode: its Rust
        router through ``ROUTER_ENTRY`` (``sglang_router.launch_router``'s flags, seconds faster to start)."""
        argv = [sys.executable, "-m", ROUTER_ENTRY, "--pd-disaggregation"]
        for url, bootstrap in zip(self.prefill_urls, self.bootstrap_ports, strict=True):
            argv += ["--prefill", url, str(bootstrap)]
        for url in self.decode_urls:
            argv += ["--decode", url]
        if not any(a.startswith("--health-check-timeout-secs") for a in self.router_args):
            argv += ["--health-check-timeout-secs", str(ROUTER_HEALTH_TIMEOUT_S)]
        return argv + ["--host", self.host, "--port", str(self.router_port),
                       "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                       *self.router_args]

    def start(self, timeout_s: float = 300.0, progress: bool = False) -> float:
        self.processes = self.server_processes()
        waited = self._launch(timeout_s, progress)
        # The router's ports are picked only now: the servers open many ports of their own while they
        # start (Mooncake's among them), and a port picked earlier may have been taken meanwhile.
        for name in ("router_port", "metrics_port"):
            if not getattr(self, name):
                setattr(self, name, free_port(self.host))
        router_proc = ManagedProcess("router", self.router_argv(), f"{self.url}/health",
                                     self._logs() / "router.log", _server_env())
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
                if self._router_knows_every_worker():
                    return time.monotonic() - started
                last_error = "the router does not list every worker as healthy yet"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last_error = str(exc)
                time.sleep(START_POLL_S)
        raise ServerStartError(f"router {self.url} did not route a request within {timeout_s:.0f} s: {last_error}")

    def _router_knows_every_worker(self) -> bool:
        """Whether the router's ``/workers`` lists every prefill and decode server as healthy (checked
        only for xPyD: in 1P1D the routed request proves it)."""
        if self.prefills == 1 and self.decodes == 1:
            return True
        with urllib.request.urlopen(f"{self.url}/workers", timeout=30) as resp:
            workers = json.loads(resp.read()).get("workers", [])
        healthy = {w.get("url") for w in workers if w.get("is_healthy")}
        return set(self.prefill_urls + self.decode_urls) <= healthy
