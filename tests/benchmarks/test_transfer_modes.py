"""bench_modes: stream sizes come from each mode's codec, and its table renders every row."""

from __future__ import annotations

import pytest
from benchmark.reporting.tables import transfer_modes_table
from benchmark.transfer.bench_modes import MODES, mode_sizes


@pytest.mark.parametrize("mode", MODES)
def test_sizes_are_the_codecs_and_only_the_two_stream_codec_sends_a_residual(mode: str) -> None:
    anchor, residual, two = mode_sizes(mode, 1024)
    bf16_bytes = 30 * 2 * 3 * 64 * 2 * 1024
    assert two == (mode in ("lynx", "lynx-int8")) and (residual > 0) == two
    assert 0 < anchor + residual <= bf16_bytes
    if mode == "bf16":
        assert anchor == bf16_bytes
    # more tokens, more bytes (no per-request constant dominates)
    assert sum(mode_sizes(mode, 4096)[:2]) > 3 * (anchor + residual)


def test_table_renders_one_line_per_row() -> None:
    rows = [{"link_gbps": 1.0, "ctx": 1024, "mode": m, "anchor_bytes": 1, "residual_bytes": 0, "bits_anchor": 4.5,
             "bits_total": 4.5, "anchor_landed_s": 0.05, "residual_landed_s": None if m != "lynx" else 0.09,
             "ideal_anchor_s": 0.05, "ideal_total_s": 0.09} for m in ("int4", "lynx")]
    text = transfer_modes_table({"emulation": "application-pacer", "rows": rows})
    assert "| 1 | 1024 | int4 | 4.50 | 4.50 | 50.0 | 50.0 | - | - |" in text
    assert "| 1 | 1024 | lynx |" in text and text.count("\n| 1 |") == 2
