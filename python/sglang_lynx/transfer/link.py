"""Link emulation for benchmarks: a real shaped link (netns + veth + tc tbf), or an application pacer.

``open_link(gbps)`` returns a :class:`Link` (use it as a context manager). Which emulation ran is in
``link.kind`` (:class:`LinkKind`) and ``link.reason``; report it with every number.

- ``NETNS_TBF``: as root, a network namespace ``lynx<pid>x<k>`` joined to the root namespace by a veth
  pair ``lx<pid>h<k>`` (host end) / ``lx<pid>n<k>`` (namespace end) on a private /24 (10.213.N.0/24, N
  chosen free) that exists only inside what we create. ``tc tbf`` shapes both directions at ``gbps``
  (with ``delay_ms``, a ``netem`` delay under each tbf: that one-way delay in each direction). One side
  runs in the namespace via ``link.exec_prefix + argv`` and is reached at ``link.peer_addr``; the other
  runs on the host and binds ``link.host_addr``. ``link.sent_bytes()`` reads both ends' tc byte
  counters (what really crossed). ``cleanup_stale_links()`` deletes the namespaces and veths of
  launchers that died without tearing down (a SIGKILL skips ``atexit``): their pid is in the name.
- ``PACER``: no namespace (not root, ``ip``/``tc`` missing or refused). The scheduler consults
  :class:`TokenBucketPacer` before each submit: the link is one FIFO wire at ``gbps``; a chunk counts
  as landed only when both Mooncake says done and its emulated crossing time has passed.
- ``NONE``: ``gbps`` is None: raw loopback.

Lifecycle of a namespace link: CREATED -> UP (set-up commands all succeeded) -> CLOSED (namespace
deleted; deleting it removes the veth pair). Tear-down runs on ``close()``, on context exit, on a
failure half-way through set-up, and at interpreter exit (``atexit``) — it is idempotent.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field

_COUNTER = itertools.count()


class LinkKind(enum.Enum):
    NETNS_TBF = "netns+veth+tc-tbf"
    PACER = "application-pacer"
    NONE = "none (raw loopback)"


class LinkState(enum.Enum):
    CREATED = "created"
    UP = "up"
    CLOSED = "closed"


class LinkSetupError(RuntimeError):
    """A namespace/veth/tc command failed; the message names the command and its stderr."""


class TokenBucketPacer:
    """One FIFO wire at ``gbps``: ``reserve(n, now)`` books n bytes and returns their landing time.

    With ``rate_file`` the rate is the number (Gb/s) written in that file, re-read at most every
    ``reread_s``: a benchmark changes the emulated link between runs without restarting servers (a
    file that is missing or not a valid rate keeps the last rate).
    """

    def __init__(self, gbps: float, rate_file: str | None = None, reread_s: float = 0.2) -> None:
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self.rate_file, self.reread_s, self._next_read = rate_file, reread_s, 0.0
        self.set_rate(gbps)

    @classmethod
    def from_rate_file(cls, path: str) -> TokenBucketPacer:
        rate = read_rate_file(path)
        if rate is None:
            raise ValueError(f"link rate file {path}: expected a rate in Gb/s (0 < rate < 10000)")
        return cls(rate, rate_file=path)

    @property
    def gbps(self) -> float:
        return self.bytes_per_s * 8 / 1e9

    def set_rate(self, gbps: float) -> None:
        if not 0 < gbps < 1e4:
            raise ValueError(f"link rate must be > 0 and < 10000 Gb/s, got {gbps}")
        self.bytes_per_s = gbps * 1e9 / 8

    def reserve(self, nbytes: int, now: float) -> float:
        with self._lock:
            if self.rate_file is not None and now >= self._next_read:
                self._next_read = now + self.reread_s
                rate = read_rate_file(self.rate_file)
                if rate is not None:
                    self.set_rate(rate)
            start = max(now, self._busy_until)
            self._busy_until = start + nbytes / self.bytes_per_s
            return self._busy_until


def read_rate_file(path: str) -> float | None:
    """The rate (Gb/s) written in ``path``, or None if the file is missing or holds no valid rate."""
    try:
        with open(path) as fh:
            rate = float(fh.read().strip())
    except (OSError, ValueError):
        return None
    return rate if 0 < rate < 1e4 else None


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise LinkSetupError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _free_subnet() -> int:
    used = _run(["ip", "-4", "-o", "addr"])
    for n in itertools.chain(range(200 + os.getpid() % 50, 250), range(200, 250)):
        if f" 10.213.{n}." not in used:
            return n
    raise LinkSetupError("no free 10.213.N.0/24 subnet (N in 200..249)")


@dataclass
class Link:
    gbps: float | None
    kind: LinkKind
    reason: str = ""
    pacer: TokenBucketPacer | None = None
    delay_ms: float = 0.0
    netns: str = ""
    host_addr: str = "127.0.0.1"
    peer_addr: str = "127.0.0.1"
    state: LinkState = LinkState.CREATED
    _cleanup: list[list[str]] = field(default_factory=list)
    _devs: tuple[str, str] = ("", "")

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix an argv with this to run it on the peer side of the link."""
        return ["ip", "netns", "exec", self.netns] if self.kind is LinkKind.NETNS_TBF else []

    def close(self) -> None:
        if self.state is LinkState.CLOSED:
            return
        for cmd in reversed(self._cleanup):
            subprocess.run(cmd, capture_output=True, timeout=20)
        self._cleanup.clear()
        self.state = LinkState.CLOSED

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_rate(self, gbps: float) -> None:
        """Re-shape the same link (``tc qdisc change`` both ends, or a fresh pacer)."""
        if self.kind is LinkKind.NETNS_TBF:
            for prefix, dev in (([], self._devs[0]), (self.exec_prefix, self._devs[1])):
                _run([*prefix, *_tbf(dev, gbps, "change")])
        elif self.kind is LinkKind.PACER:
            self.pacer = TokenBucketPacer(gbps)
        else:
            raise LinkSetupError("set_rate on an unshaped link: open it with a rate")
        self.gbps = gbps

    def describe(self) -> str:
        rate = "unshaped" if self.gbps is None else f"{self.gbps:g} Gb/s"
        delay = f", {self.delay_ms:g} ms one-way delay" if self.delay_ms else ""
        return f"{self.kind.value} at {rate}{delay}" + (f" ({self.reason})" if self.reason else "")

    def sent_bytes(self) -> tuple[int, int]:
        """Bytes the root qdisc of each end has sent so far: (host -> namespace, namespace -> host)."""
        if self.kind is not LinkKind.NETNS_TBF or self.state is not LinkState.UP:
            raise LinkSetupError(f"sent_bytes needs an open namespace link (this one: {self.describe()})")
        counts = []
        for prefix, dev in (([], self._devs[0]), (self.exec_prefix, self._devs[1])):
            out = _run([*prefix, "tc", "-s", "qdisc", "show", "dev", dev, "root"])
            match = re.search(r"Sent (\d+) bytes", out)
            if match is None:
                raise LinkSetupError(f"no byte counter in `tc -s qdisc show dev {dev}`: {out!r}")
            counts.append(int(match.group(1)))
        return counts[0], counts[1]


def _tbf(dev: str, gbps: float, verb: str = "add") -> list[str]:
    rate_bytes = gbps * 1e9 / 8
    burst = max(32 * 1024, int(rate_bytes * 0.002))  # >= 2 ms of traffic (timer granularity)
    return ["tc", "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{int(gbps * 1000)}mbit",
            "burst", str(burst), "latency", "50ms"]


def _netem(dev: str, delay_ms: float) -> list[str]:
    """A delay under the tbf (its one class is 1:1); the queue is long enough for the tbf's backlog."""
    return ["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
            "delay", f"{delay_ms:g}ms", "limit", "100000"]


_STALE_NETNS = re.compile(r"^lynx(\d+)x\d+$")
_STALE_DEV = re.compile(r"^lx(\d+)[hn]\d+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_links() -> list[str]:
    """Delete the namespaces ``lynx<pid>x<k>`` and host veths ``lx<pid>h<k>`` whose ``pid`` is no
    longer running (a launcher killed before its tear-down). Returns what was deleted; a no-op when
    not root or without ``ip``."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    removed = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _STALE_NETNS.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
            removed.append(f"netns {name}")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    for line in links.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        match = _STALE_DEV.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=20)
            removed.append(f"veth {name}")
    return removed


def open_netns_link(gbps: float, delay_ms: float = 0.0) -> Link:
    """Create a namespace + shaped veth pair; raise :class:`LinkSetupError` (after tearing down)."""
    if os.geteuid() != 0:
        raise LinkSetupError("network namespaces need root (euid != 0)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkSetupError(f"`{tool}` not found")
    k = next(_COUNTER)
    ns, host_dev, peer_dev = f"lynx{os.getpid()}x{k}", f"lx{os.getpid()}h{k}", f"lx{os.getpid()}n{k}"
    if delay_ms < 0:
        raise LinkSetupError(f"delay must be >= 0 ms, got {delay_ms}")
    cleanup_stale_links()
    link = Link(gbps, LinkKind.NETNS_TBF, delay_ms=delay_ms, netns=ns, _devs=(host_dev, peer_dev))
    atexit.register(link.close)
    try:
        n = _free_subnet()
        link.host_addr, link.peer_addr = f"10.213.{n}.1", f"10.213.{n}.2"
        _run(["ip", "netns", "add", ns])
        link._cleanup.append(["ip", "netns", "del", ns])
        _run(["ip", "link", "add", host_dev, "type", "veth", "peer", "name", peer_dev])
        link._cleanup.append(["ip", "link", "del", host_dev])  # in case the move below fails
        _run(["ip", "link", "set", peer_dev, "netns", ns])
        _run(["ip", "addr", "add", f"{link.host_addr}/24", "dev", host_dev])
        _run(["ip", "link", "set", host_dev, "up"])
        in_ns = ["ip", "netns", "exec", ns]
        _run([*in_ns, "ip", "addr", "add", f"{link.peer_addr}/24", "dev", peer_dev])
        _run([*in_ns, "ip", "link", "set", peer_dev, "up"])
        _run([*in_ns, "ip", "link", "set", "lo", "up"])
        _run(_tbf(host_dev, gbps))
        _run([*in_ns, *_tbf(peer_dev, gbps)])
        if delay_ms:
            try:
                _run(_netem(host_dev, delay_ms))
                _run([*in_ns, *_netem(peer_dev, delay_ms)])
            except LinkSetupError as exc:
                raise LinkSetupError(f"a {delay_ms:g} ms delay needs the kernel's netem qdisc: {exc}") from exc
    except (LinkSetupError, OSError, subprocess.TimeoutExpired) as exc:
        link.close()
        raise LinkSetupError(f"netns link set-up failed and was torn down: {exc}") from exc
    link.state = LinkState.UP
    return link


def open_link(gbps: float | None, prefer_netns: bool = True, delay_ms: float = 0.0) -> Link:
    """The best emulation this machine allows for ``gbps`` (None: raw loopback). The pacer has no
    delay: a ``delay_ms`` the namespace link cannot give falls back to the pacer and says so."""
    if gbps is None:
        return Link(None, LinkKind.NONE, state=LinkState.UP)
    if prefer_netns:
        try:
            return open_netns_link(gbps, delay_ms)
        except LinkSetupError as exc:
            reason = f"netns unavailable: {exc}"
    else:
        reason = "netns not requested"
    return Link(gbps, LinkKind.PACER, reason=reason, pacer=TokenBucketPacer(gbps), state=LinkState.UP)
