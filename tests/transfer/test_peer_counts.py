"""Per-peer request counts (``transfer/peer_counts.py``): counts, in-flight peers, the peak, the bound."""

from __future__ import annotations

import pytest

from sglang_lynx.transfer.peer_counts import PeerCounts


def test_counts_in_flight_and_peak_follow_starts_and_ends() -> None:
    counts = PeerCounts()
    counts.start("a")
    counts.start("b")
    counts.start("a")
    snap = counts.snapshot()
    assert snap["requests"] == {"a": 2, "b": 1} and snap["in_flight"] == {"a": 2, "b": 1}
    assert snap["peak_peers_at_once"] == 2
    counts.end("a")
    counts.end("b")
    counts.end("b")  # more ends than starts never goes below zero
    assert counts.snapshot()["in_flight"] == {"a": 1}
    counts.end("a")
    snap = counts.snapshot()
    assert snap["in_flight"] == {} and snap["requests"] == {"a": 2, "b": 1} and snap["peak_peers_at_once"] == 2


def test_peers_beyond_the_bound_fold_into_dropped() -> None:
    counts = PeerCounts(max_peers=2)
    for peer in ("a", "b", "a", "c"):
        counts.start(peer)
        counts.end(peer)
    snap = counts.snapshot()
    assert snap["requests"] == {"a": 2, "c": 1} and snap["dropped"] == 1
    counts.start(None)
    assert counts.snapshot()["requests"]["?"] == 1
    with pytest.raises(ValueError, match="max_peers"):
        PeerCounts(max_peers=0)
