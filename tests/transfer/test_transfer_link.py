"""Tier (c): the shaped netns/veth/tc link (root only) and the application pacer's link model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from sglang_lynx.transfer.link import LinkKind, LinkState, TokenBucketPacer, open_link

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5999)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); n = 0
while (d := c.recv(1 << 20)):
    n += len(d)
c.sendall(str(n).encode()); c.close()
"""


def test_pacer_models_one_fifo_wire() -> None:
    pacer = TokenBucketPacer(8.0)  # 1 GB/s
    t1 = pacer.reserve(1_000_000, now=10.0)
    t2 = pacer.reserve(1_000_000, now=10.0)  # queued behind the first
    t3 = pacer.reserve(1_000, now=20.0)  # idle link: starts at once
    assert t1 == pytest.approx(10.001) and t2 == pytest.approx(10.002) and t3 == pytest.approx(20.000001)
    with pytest.raises(ValueError):
        TokenBucketPacer(0)
    link = open_link(2.5, prefer_netns=False)
    assert link.kind is LinkKind.PACER and link.pacer is not None and "not requested" in link.describe()


def test_pacer_follows_its_rate_file(tmp_path) -> None:
    rate = tmp_path / "gbps"
    rate.write_text("8\n")
    pacer = TokenBucketPacer.from_rate_file(str(rate))
    assert pacer.gbps == pytest.approx(8.0)
    assert pacer.reserve(1_000_000, now=10.0) == pytest.approx(10.001)  # 1 GB/s
    rate.write_text("0.8")
    assert pacer.reserve(1_000_000, now=10.1) == pytest.approx(10.101)  # re-read not due yet: still 1 GB/s
    assert pacer.reserve(1_000_000, now=20.0) == pytest.approx(20.01)  # re-read: 100 MB/s
    for bad in ("fast", "0", "-3", ""):
        rate.write_text(bad)
        pacer.reserve(1, now=30.0 + len(bad))  # an invalid rate keeps the last good one
        assert pacer.gbps == pytest.approx(0.8), bad
    rate.unlink()
    pacer.reserve(1, now=40.0)
    assert pacer.gbps == pytest.approx(0.8)
    with pytest.raises(ValueError, match="rate file"):
        TokenBucketPacer.from_rate_file(str(rate))


@pytest.mark.netns
@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root; this run is not root")
def test_netns_tbf_link_shapes_tcp_and_is_torn_down() -> None:
    gbps = 0.2
    with open_link(gbps) as link:
        assert link.kind is LinkKind.NETNS_TBF, link.reason
        ns = link.netns
        assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        srv = subprocess.Popen([*link.exec_prefix, sys.executable, "-c", SERVER, link.peer_addr])
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    conn = socket.create_connection((link.peer_addr, 5999), timeout=5)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "server in the namespace never listened"
                    time.sleep(0.1)
            payload, n = b"\x5a" * (1 << 20), 6
            t0 = time.monotonic()
            for _ in range(n):
                conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(20)
            got = int(conn.recv(64))
            mbps = n * len(payload) * 8 / (time.monotonic() - t0) / 1e6
            conn.close()
        finally:
            srv.kill()
            srv.wait(10)
    assert got == n * len(payload)
    assert 0.6 * gbps * 1000 < mbps < 1.15 * gbps * 1000, f"{mbps:.1f} Mbit/s on a {gbps} Gb/s link"
    assert link.state is LinkState.CLOSED
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
