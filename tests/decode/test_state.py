"""Per-request state machine and decision function of sglang_lynx.decode.state (pure, fast)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import (
    TERMINAL_PHASES,
    TRANSITIONS,
    Action,
    IllegalTransition,
    LynxRequestState,
    Phase,
    next_action,
)


@dataclass
class FakeProgress:
    """Test double of the transport-side LandingProgress."""

    anchor: bool = False
    residual: bool = False
    error: str | None = None
    upgrades: int = 0

    def anchor_landed(self) -> bool:
        return self.anchor

    def residual_landed(self) -> bool:
        return self.residual

    def failure(self) -> str | None:
        return self.error

    def upgrade_kv(self) -> None:
        self.upgrades += 1


CONFIG = LynxConfig(max_draft_tokens=4, residual_timeout_s=2.0, fallback="recompute")


def test_every_illegal_transition_is_rejected_and_leaves_state_unchanged() -> None:
    for source in Phase:
        for target in Phase:
            state = LynxRequestState("r", CONFIG, phase=source)
            if target in TRANSITIONS[source]:
                state.advance(target)
                assert state.phase is target and state.history == [source]
            else:
                with pytest.raises(IllegalTransition, match=f"{source.name} -> {target.name}"):
                    state.advance(target)
                assert state.phase is source and state.history == []


def test_terminal_phases_have_no_exit_and_every_live_phase_can_abort() -> None:
    for phase in Phase:
        if phase in TERMINAL_PHASES:
            assert not TRANSITIONS[phase]
        else:
            assert Phase.ABORTED in TRANSITIONS[phase]


def test_happy_path_and_released_token_counts() -> None:
    state = LynxRequestState("r", CONFIG, created_at=100.0)
    state.on_anchor_admitted(output_len=1, now=100.5)
    assert state.phase is Phase.DRAFTING
    for drafted in range(1, 4):
        state.on_draft_token()
        assert state.releasable_output_len(1 + drafted) == 1  # drafts are withheld
    state.on_draft_token()
    assert state.phase is Phase.WAITING_RESIDUAL  # cap of 4 reached
    state.advance(Phase.VERIFYING)
    state.residual_landed_at = 101.0
    state.full_ready_at, state.exact_ahead = 101.25, 0.93751
    assert state.releasable_output_len(5) == 1
    state.on_verified(num_accepted=2, new_output_len=4, seconds=0.25)
    assert state.phase is Phase.NORMAL
    assert state.releasable_output_len(9) == 9
    assert state.meta_info() == {
        "lynx_phase": "normal",
        "lynx_anchor_landed_s": 0.5,
        "lynx_residual_landed_s": 1.0,
        "lynx_drafts": 4,
        "lynx_accepted": 2,
        "lynx_bonus": 0,
        "lynx_verify_s": 0.25,
        "lynx_upgrade_s": 0.0,
        "lynx_full_ready_s": 1.25,
        "lynx_exact_ahead": 0.9375,
        "lynx_fallback": None,
    }


def test_draft_outside_drafting_and_overcounted_accepts_are_errors() -> None:
    state = LynxRequestState("r", CONFIG)
    with pytest.raises(IllegalTransition):
        state.on_draft_token()
    state.on_anchor_admitted(output_len=1, now=0.0)
    state.on_draft_token()
    state.advance(Phase.VERIFYING)
    with pytest.raises(ValueError, match="accepted 2 of 1"):
        state.on_verified(num_accepted=2, new_output_len=3, seconds=0.0)


def test_failed_and_aborted_release_only_verified_tokens() -> None:
    for end in (Phase.FAILED, Phase.ABORTED):
        state = LynxRequestState("r", CONFIG)
        state.on_anchor_admitted(output_len=1, now=0.0)
        state.on_draft_token()
        state.advance(end)
        assert state.releasable_output_len(2) == 1


@pytest.mark.parametrize(
    ("phase", "progress", "drafts", "now", "policy", "expected"),
    [
        (Phase.WAITING_ANCHOR, FakeProgress(), 0, 0.0, "recompute", Action.WAIT_ANCHOR),
        (Phase.WAITING_ANCHOR, FakeProgress(anchor=True), 0, 0.0, "recompute", Action.DRAFT),
        (Phase.WAITING_ANCHOR, FakeProgress(anchor=True, residual=True), 0, 0.0, "recompute", Action.VERIFY),
        (Phase.WAITING_ANCHOR, FakeProgress(error="anchor lost"), 0, 0.0, "recompute", Action.FAIL),
        (Phase.DRAFTING, FakeProgress(anchor=True), 3, 0.0, "recompute", Action.DRAFT),
        (Phase.DRAFTING, FakeProgress(anchor=True), 4, 0.0, "recompute", Action.WAIT_RESIDUAL),
        (Phase.DRAFTING, FakeProgress(anchor=True, residual=True), 2, 0.0, "recompute", Action.VERIFY),
        (Phase.WAITING_RESIDUAL, FakeProgress(anchor=True, residual=True), 4, 9.0, "fail", Action.VERIFY),
        (Phase.DRAFTING, FakeProgress(anchor=True, error="reset"), 2, 0.0, "recompute",
         Action.FALLBACK_RECOMPUTE),
        (Phase.DRAFTING, FakeProgress(anchor=True, error="reset"), 2, 0.0, "fail", Action.FAIL),
        (Phase.WAITING_RESIDUAL, FakeProgress(anchor=True), 4, 2.0, "recompute", Action.FALLBACK_RECOMPUTE),
        (Phase.WAITING_RESIDUAL, FakeProgress(anchor=True), 4, 1.9, "fail", Action.WAIT_RESIDUAL),
        (Phase.WAITING_RESIDUAL, FakeProgress(anchor=True), 4, 2.0, "fail", Action.FAIL),
        (Phase.NORMAL, FakeProgress(anchor=True, residual=True), 4, 0.0, "fail", Action.DECODE),
        (Phase.VERIFYING, FakeProgress(anchor=True, residual=True), 4, 0.0, "fail", Action.NONE),
        (Phase.ABORTED, FakeProgress(), 0, 0.0, "fail", Action.NONE),
    ],
)
def test_next_action(
    phase: Phase, progress: FakeProgress, drafts: int, now: float, policy: str, expected: Action
) -> None:
    config = LynxConfig(max_draft_tokens=4, residual_timeout_s=2.0, fallback=policy)
    deadline = None if phase is Phase.WAITING_ANCHOR else 2.0  # anchor landed at t = 0
    assert next_action(phase, progress, drafts, deadline, now, config) is expected


def test_residual_deadline_follows_config() -> None:
    state = LynxRequestState("r", CONFIG)
    assert state.residual_deadline() is None
    state.on_anchor_admitted(output_len=1, now=10.0)
    assert state.residual_deadline() == 12.0
