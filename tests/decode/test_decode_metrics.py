"""Lynx aggregate counters: kept in COUNTS and in prometheus_client's default registry."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from sglang_lynx.integration import decode_metrics


def test_count_updates_both_views() -> None:
    before = decode_metrics.COUNTS["accepted"]
    prom_before = REGISTRY.get_sample_value("sglang_lynx_accepted_total") or 0.0
    decode_metrics.count("accepted", 5)
    assert decode_metrics.COUNTS["accepted"] == before + 5
    assert REGISTRY.get_sample_value("sglang_lynx_accepted_total") == prom_before + 5


def test_unknown_counter_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown Lynx counter"):
        decode_metrics.count("bogus")
