"""One Lynx request as the decode scheduler hooks track it, and the test-only residual holds.

A :class:`Tracked` ties SGLang's ``Req`` to its transport progress (``LandingProgress``) and its
:class:`~sglang_lynx.decode.state.LynxRequestState`. Invariant: ``residual_landed()`` is the only
place the decision functions learn that the residual is usable; the test holds apply there. The
decision functions read the transport only through the ``agreed_*`` view, which
``decode.rank_agreement.agree_on_transport`` sets before each scheduler pass: the same on every
tensor-parallel rank (with one rank, this rank's own transport state).

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
from sglang_lynx.integration.decode.rank_agreement import OTHER_RANK_FAILURE

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
    # the transport as every TP rank sees it (decode.rank_agreement), refreshed before each pass
    agreed_landed: bool = False  # the residual landed on every rank
    agreed_failed: bool = False  # a stream failed on some rank
    agreed_late: bool = False  # the residual deadline passed on some rank
    abort_requested: bool = False  # aborted while parked with a batch in flight: ended at the next batch hook

    def residual_landed(self) -> bool:
        if self.ignore_residual:
            return False
        if self.hold_drafts is not None and self.state.num_drafts < self.hold_drafts and not self.finish_undone \
                and self.state.phase is Phase.DRAFTING:
            return False  # test hold: not before k drafts, unless the draft window already closed
        return self.agreed_landed

    def failure(self) -> str | None:
        """This rank's failure reason when a stream failed on any rank (agreed), else None."""
        if not self.agreed_failed:
            return None
        return self.progress.failure() or OTHER_RANK_FAILURE  # type: ignore[no-any-return]

    def residual_deadline(self) -> float | None:
        """When the residual counts as late; None once it really landed (a test hold that withholds
        a landed residual must not turn into the late-residual policy on a slow host)."""
        if not self.ignore_residual and self.progress.failure() is None and self.progress.residual_landed():
            return None
        return self.state.residual_deadline()


class HeldProgress:
    """The transport's progress as the decision function sees it (agreed view, test hold applied)."""

    def __init__(self, tracked: Tracked) -> None:
        self.t = tracked

    def anchor_landed(self) -> bool:
        return bool(self.t.progress.anchor_landed())

    def residual_landed(self) -> bool:
        return self.t.residual_landed()

    def failure(self) -> str | None:
        return self.t.failure()

    def upgrade_kv(self) -> None:
        self.t.progress.upgrade_kv()


def proposed_seed(req: Any) -> int:
    """The seed of a request's uniforms: ``sampling_seed`` when the client gives one, else random (at
    TP > 1 the ranks then agree on one: ``decode.rank_agreement.agree_seeds``)."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    return int(seed) if seed is not None else random.getrandbits(62)


def generator_for(req: Any, seed: int | None = None, device: Any = "cpu") -> torch.Generator:
    """A request's own uniforms, on ``device`` (the model's: the verify draws them where the logits
    are); reproducible from ``sampling_seed`` when the client gives one."""
    return torch.Generator(device=torch.device(device)).manual_seed(proposed_seed(req) if seed is None else int(seed))


def model_device(scheduler: Any) -> Any:
    """The device of ``scheduler``'s model (SGLang's ``model_runner.device``; "cpu" when unknown)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    return getattr(runner, "device", None) or "cpu"


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
