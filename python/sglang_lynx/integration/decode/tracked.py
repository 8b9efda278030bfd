"""One Lynx request as the decode scheduler hooks track it, and the test-only residual holds.

A :class:`Tracked` ties SGLang's ``Req`` to its transport progress (``LandingProgress``) and its
:class:`~sglang_lynx.decode.state.LynxRequestState`. Invariant: ``residual_landed()`` is the only
place the decision functions learn that the residual is usable; the test holds apply there.

Test-only (``SGLANG_LYNX_TEST_HOOKS=1`` on the decode server, read per request from
``sampling_params.custom_params``): ``lynx_test_hold_residual_drafts = k`` — the residual counts as
landed only once k drafts exist or the draft window closed (k = 0: verify before any draft);
``lynx_test_ignore_residual = true`` — the residual never counts (the late-residual policy runs).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lynx.decode.state import LynxRequestState, Phase

STATE_ATTR = "_lynx"  # a decode scheduler's DecodeLynxState, and a tracked Req's (decode_state)
TEST_HOOKS_ENV = "SGLANG_LYNX_TEST_HOOKS"
HOLD_RESIDUAL_KEY = "lynx_test_hold_residual_drafts"
IGNORE_RESIDUAL_KEY = "lynx_test_ignore_residual"


@dataclass
class Tracked:
    req: Any
    room: int
    progress: Any  # InboundProgress of the transport (LandingProgress)
    state: LynxRequestState
    greedy: bool
    blocker: str | None = None  # why this request may not draft (decode_sampling.speculation_blocker)
    generator: torch.Generator | None = None  # sampling requests: uniforms for speculative sampling
    hold_drafts: int | None = None
    finish_undone: bool = False
    ignore_residual: bool = False  # test only: the residual never counts (forces the late-residual policy)
    internal_error: str | None = None  # a Lynx step raised for this request: it is failed at the next batch
    abort_requested: bool = False  # aborted while parked with a batch in flight: ended at the next batch hook

    def residual_landed(self) -> bool:
        if self.ignore_residual:
            return False
        if self.hold_drafts is not None and self.state.num_drafts < self.hold_drafts and not self.finish_undone \
                and self.state.phase is Phase.DRAFTING:
            return False  # test hold: not before k drafts, unless the draft window already closed
        return bool(self.progress.residual_landed())

    def residual_deadline(self) -> float | None:
        """When the residual counts as late; None once it really landed (a test hold that withholds
        a landed residual must not turn into the late-residual policy on a slow host)."""
        if not self.ignore_residual and self.progress.failure() is None and self.progress.residual_landed():
            return None
        return self.state.residual_deadline()


class HeldProgress:
    """The transport's progress as the decision function sees it (test hold applied)."""

    def __init__(self, tracked: Tracked) -> None:
        self.t = tracked

    def anchor_landed(self) -> bool:
        return bool(self.t.progress.anchor_landed())

    def residual_landed(self) -> bool:
        return self.t.residual_landed()

    def failure(self) -> str | None:
        return self.t.progress.failure()  # type: ignore[no-any-return]

    def upgrade_kv(self) -> None:
        self.t.progress.upgrade_kv()


def generator_for(req: Any) -> torch.Generator:
    """A request's own uniforms: reproducible from ``sampling_seed`` when the client gives one."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    return torch.Generator().manual_seed(int(seed) if seed is not None else random.getrandbits(63))


def test_params(req: Any) -> dict[str, Any]:
    """The request's ``custom_params`` when test hooks are on, else nothing."""
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        return {}
    return dict(getattr(req.sampling_params, "custom_params", None) or {})


def hold_from(req: Any) -> int | None:
    value = test_params(req).get(HOLD_RESIDUAL_KEY)
    return None if value is None else int(value)


def ignores_residual(req: Any) -> bool:
    return bool(test_params(req).get(IGNORE_RESIDUAL_KEY))
