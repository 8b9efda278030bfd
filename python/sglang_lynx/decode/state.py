"""Per-request state machine of progressive speculative decoding (pure logic, no SGLang).

Lifecycle of one Lynx request on the decode server::

    WAITING_ANCHOR --anchor landed--> DRAFTING --cap reached--> WAITING_RESIDUAL
          |                              |  \\                         |
          |                              |   +--residual landed--+    |
          |                              |                       v    v
          +--both streams landed-----------------------------> VERIFYING --> NORMAL
    any live phase --residual failed / late--> FALLBACK (policy "recompute") --> NORMAL
                                           --> FAILED   (policy "fail", or a fallback that failed)
    any non-terminal phase --abort--> ABORTED

Invariants:
- clients never see an unverified token: :meth:`LynxRequestState.releasable_output_len` is the
  number of ``output_ids`` that may be streamed; before NORMAL it counts only the exact first token
  (from the prefill server) and verified tokens; drafts on the anchor-only KV are never counted.
- transitions go through :meth:`LynxRequestState.advance`, which rejects anything not in
  :data:`TRANSITIONS` with :class:`IllegalTransition`; FAILED and ABORTED are terminal.
- :func:`next_action` is a pure decision function: given the phase, the stream progress, the number
  of drafts and the clock it says what the scheduler does next; the scheduler hooks only execute it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from sglang_lynx.config import LynxConfig


class LandingProgress(Protocol):
    """What the transport exposes per decode-side request (implemented in ``transfer``)."""

    def anchor_landed(self) -> bool: ...

    def residual_landed(self) -> bool: ...

    def failure(self) -> str | None: ...

    def upgrade_kv(self) -> None:
        """Replace the request's anchor-only KV in the pool by the full reconstruction."""
        ...


class Phase(enum.Enum):
    WAITING_ANCHOR = "waiting_anchor"
    DRAFTING = "drafting"
    WAITING_RESIDUAL = "waiting_residual"
    VERIFYING = "verifying"
    NORMAL = "normal"
    FALLBACK = "fallback"
    FAILED = "failed"
    ABORTED = "aborted"


TERMINAL_PHASES = frozenset({Phase.FAILED, Phase.ABORTED})
#: Phases in which output_ids may hold drafts (tokens computed on the anchor-only KV).
SPECULATIVE_PHASES = frozenset({Phase.DRAFTING, Phase.WAITING_RESIDUAL, Phase.VERIFYING})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING_ANCHOR: frozenset(
        {Phase.DRAFTING, Phase.VERIFYING, Phase.NORMAL, Phase.FAILED, Phase.ABORTED}
    ),
    Phase.DRAFTING: frozenset(
        {Phase.WAITING_RESIDUAL, Phase.VERIFYING, Phase.FALLBACK, Phase.FAILED, Phase.ABORTED}
    ),
    Phase.WAITING_RESIDUAL: frozenset({Phase.VERIFYING, Phase.FALLBACK, Phase.FAILED, Phase.ABORTED}),
    Phase.VERIFYING: frozenset({Phase.NORMAL, Phase.FAILED, Phase.ABORTED}),
    Phase.FALLBACK: frozenset({Phase.NORMAL, Phase.FAILED, Phase.ABORTED}),
    Phase.NORMAL: frozenset({Phase.ABORTED}),
    Phase.FAILED: frozenset(),
    Phase.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A phase change that the transition table does not allow."""


class Action(enum.Enum):
    """What the scheduler should do with a Lynx request before its next step."""

    WAIT_ANCHOR = "wait_anchor"  # nothing landed yet: stay out of the batch
    DRAFT = "draft"  # decode one more draft token on the anchor-only KV
    WAIT_RESIDUAL = "wait_residual"  # draft cap reached: park the request
    VERIFY = "verify"  # residual landed: upgrade KV, one chain forward, accept/reject
    FALLBACK_RECOMPUTE = "fallback_recompute"  # residual failed or late; policy "recompute"
    FAIL = "fail"  # residual failed or late; policy "fail" -> abort with a clear error
    DECODE = "decode"  # ordinary decoding (NORMAL)
    NONE = "none"  # terminal or busy (VERIFYING / FALLBACK in progress)


def next_action(
    phase: Phase,
    progress: LandingProgress,
    num_drafts: int,
    residual_deadline: float | None,
    now: float,
    config: LynxConfig,
) -> Action:
    """The decision, made before every step (the paper checks the residual before each token)."""
    if phase in TERMINAL_PHASES or phase in (Phase.VERIFYING, Phase.FALLBACK):
        return Action.NONE
    if phase is Phase.NORMAL:
        return Action.DECODE
    failure = progress.failure()
    if phase is Phase.WAITING_ANCHOR:
        if failure is not None:
            return Action.FAIL  # nothing was drafted; the transfer itself failed
        if progress.residual_landed():
            return Action.VERIFY
        return Action.DRAFT if progress.anchor_landed() else Action.WAIT_ANCHOR
    late = residual_deadline is not None and now >= residual_deadline
    if progress.residual_landed() and failure is None:
        return Action.VERIFY
    if failure is not None or late:
        return Action.FALLBACK_RECOMPUTE if config.fallback == "recompute" else Action.FAIL
    return Action.DRAFT if num_drafts < config.max_draft_tokens else Action.WAIT_RESIDUAL


@dataclass
class LynxRequestState:
    """Bookkeeping of one request; ``verified_output_len`` counts releasable ``output_ids``."""

    rid: str
    config: LynxConfig
    phase: Phase = Phase.WAITING_ANCHOR
    verified_output_len: int = 0
    created_at: float = field(default_factory=time.monotonic)
    anchor_landed_at: float | None = None
    residual_landed_at: float | None = None
    num_drafts: int = 0
    num_accepted: int = 0
    num_verifies: int = 0
    num_bonus: int = 0  # tokens released after a fully accepted draft window by the verify itself
    verify_time_s: float = 0.0
    upgrade_time_s: float = 0.0  # of verify_time_s: writing the full KV over the anchor-only KV
    full_ready_at: float | None = None  # lynx-exact: when the decode side had the full KV restored
    exact_ahead: float | None = None  # lynx-exact: share of the KV values restored before the last landing
    fallback: str | None = None
    failure: str | None = None
    history: list[Phase] = field(default_factory=list)

    def advance(self, target: Phase) -> None:
        """Move to ``target`` or raise :class:`IllegalTransition` (state is left unchanged)."""
        if target not in TRANSITIONS[self.phase]:
            allowed = ", ".join(sorted(p.name for p in TRANSITIONS[self.phase])) or "none (terminal)"
            raise IllegalTransition(
                f"request {self.rid}: {self.phase.name} -> {target.name} is not allowed; from "
                f"{self.phase.name} allowed: {allowed}"
            )
        self.history.append(self.phase)
        self.phase = target

    # ----- event helpers: each is one transition plus its bookkeeping -----
    def on_anchor_admitted(self, output_len: int, now: float | None = None) -> None:
        """The anchor landed and the request joins decoding; its first token(s) are exact."""
        self.anchor_landed_at = time.monotonic() if now is None else now
        self.verified_output_len = output_len
        self.advance(Phase.DRAFTING)

    def residual_deadline(self) -> float | None:
        if self.anchor_landed_at is None:
            return None
        return self.anchor_landed_at + self.config.residual_timeout_s

    def on_draft_token(self) -> None:
        if self.phase is not Phase.DRAFTING:
            raise IllegalTransition(f"request {self.rid}: a draft token in phase {self.phase.name}")
        self.num_drafts += 1
        if self.num_drafts >= self.config.max_draft_tokens:
            self.advance(Phase.WAITING_RESIDUAL)

    def on_verified(self, num_accepted: int, new_output_len: int, seconds: float, upgrade_s: float = 0.0) -> None:
        """Verification finished: ``new_output_len`` tokens (all verified) remain in output_ids; it took
        ``seconds``, of which ``upgrade_s`` went to the KV upgrade."""
        if self.phase is not Phase.VERIFYING:
            raise IllegalTransition(f"request {self.rid}: verify result in phase {self.phase.name}")
        if not 0 <= num_accepted <= self.num_drafts:
            raise ValueError(f"accepted {num_accepted} of {self.num_drafts} drafts")
        self.num_accepted += num_accepted
        self.num_verifies += 1
        self.verify_time_s += seconds
        self.upgrade_time_s += upgrade_s
        self.verified_output_len = new_output_len
        self.advance(Phase.NORMAL)

    def releasable_output_len(self, output_len: int) -> int:
        """How many of ``output_len`` output ids a client may see now (never an unverified one)."""
        if self.phase is Phase.NORMAL:
            return output_len
        return min(output_len, self.verified_output_len)

    def meta_info(self) -> dict[str, float | int | str | None]:
        """Per-request fields for SGLang's ``meta_info`` (times relative to :attr:`created_at`)."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - self.created_at, 6)

        return {
            "lynx_phase": self.phase.value,
            "lynx_anchor_landed_s": rel(self.anchor_landed_at),
            "lynx_residual_landed_s": rel(self.residual_landed_at),
            "lynx_drafts": self.num_drafts,
            "lynx_accepted": self.num_accepted,
            "lynx_bonus": self.num_bonus,
            "lynx_verify_s": round(self.verify_time_s, 6),
            "lynx_upgrade_s": round(self.upgrade_time_s, 6),
            "lynx_full_ready_s": rel(self.full_ready_at),
            "lynx_exact_ahead": None if self.exact_ahead is None else round(self.exact_ahead, 4),
            "lynx_fallback": self.fallback,
        }
