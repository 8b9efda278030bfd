"""Lynx aggregate counters: kept per server (ServerCounts) and in prometheus_client's default registry."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from sglang_lynx.integration.decode import metrics as decode_metrics


def test_count_updates_both_views_and_servers_keep_their_own_totals() -> None:
    mine, other = decode_metrics.ServerCounts(), decode_metrics.ServerCounts()
    prom_before = REGISTRY.get_sample_value("sglang_lynx_accepted_total") or 0.0
    mine.count("accepted", 5)
    assert mine.snapshot()["accepted"] == 5 and other.snapshot()["accepted"] == 0
    assert REGISTRY.get_sample_value("sglang_lynx_accepted_total") == prom_before + 5


def test_unknown_counter_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown Lynx counter"):
        decode_metrics.ServerCounts().count("bogus")
