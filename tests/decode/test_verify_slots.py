"""slots_to_free_after_verify: which row positions are stale after a verify (pure)."""

from __future__ import annotations

import pytest

from sglang_lynx.integration.decode.verify import slots_to_free_after_verify


def test_kept_kv_is_prefix_plus_outputs_minus_the_next_input() -> None:
    # prompt 100, drafted 10 (outputs t0 + 10 drafts, KV for 10 positions: 100..109 -> allocated 110)
    # verify accepted 3 and corrected one: outputs t0, d1..d3, c -> KV valid for t0..d3 -> 104
    assert slots_to_free_after_verify(100, 5, 110) == (104, 110)
    assert slots_to_free_after_verify(100, 11, 110) == (110, 110)  # full accept frees nothing


def test_bad_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="first"):
        slots_to_free_after_verify(100, 0, 110)
    with pytest.raises(ValueError, match="exceeds"):
        slots_to_free_after_verify(100, 20, 110)
