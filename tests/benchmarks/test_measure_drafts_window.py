"""measure_drafts' recent-window rows: the last R tokens coded by int8 g64, the rest by the row's codec."""

from __future__ import annotations

import pytest
import torch
from benchmark.codec.measure_drafts import VARIANT_SETS, WINDOW_KEY, quantized_kv, window_bits

from sglang_lynx.codec.layout import wire_bits_per_value
from sglang_lynx.codec.registry import get_codec


def _alone(name: str, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` ([H, L, D] bf16) coded by ``name`` on its own, back as [H, L, D] float32."""
    codec = get_codec(name)
    enc = codec.encode(x.transpose(0, 1).contiguous(), kind, layer=0)
    return codec.decode(enc, with_residual=False, dtype=torch.float32).transpose(0, 1)


def _err(y: torch.Tensor, x: torch.Tensor, lo: int) -> float:
    return float((y[:, lo:] - x[:, lo:].float()).norm() / x[:, lo:].float().norm())


@pytest.mark.parametrize("base", ["int4", "kivi-int4"])
def test_a_window_row_codes_its_last_tokens_with_int8_and_the_rest_on_their_own(base: str) -> None:
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, 150, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    rows = [("plain", base, {}, False), ("window", base, {WINDOW_KEY: 48}, False)]
    (plain,), (window,) = quantized_kv([(k, v)], rows)
    for got, full, x, kind in ((window[0], plain[0], k, "k"), (window[1], plain[1], v, "v")):
        assert got.shape == x.shape == full.shape
        assert torch.equal(got[:, 102:], _alone("int8", x[:, 102:], kind))
        assert torch.equal(got[:, :102], _alone(base, x[:, :102], kind))
        assert _err(got, x, 102) < _err(full, x, 102) / 5  # 8 bits on the window, 4 without


def test_window_bits_weigh_the_two_codes_by_tokens() -> None:
    int4 = wire_bits_per_value("int4", 976, 3, 64)[0]
    int8 = wire_bits_per_value("int8", 48, 3, 64)[0]
    assert window_bits("int4", {WINDOW_KEY: 48}, 1024, False) == pytest.approx((976 * int4 + 48 * int8) / 1024)
    assert window_bits("int4", {}, 1024, False) == pytest.approx(4.5)
    assert window_bits("int4", {WINDOW_KEY: 2000}, 1024, False) == pytest.approx(8.5)  # all window
    # at 1K tokens the windowed 4-bit rows sit at the lynx anchor's bits (4.70): equal bits, equal recency
    rows = {label: (name, params, res) for label, name, params, res in VARIANT_SETS["window"]}
    anchor = window_bits(*rows["lynx anchor (lynx-int4)"][:2], 1024, False)
    assert abs(window_bits("int4", {WINDOW_KEY: 48}, 1024, False) - anchor) < 0.05
