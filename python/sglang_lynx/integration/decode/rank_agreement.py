"""Tensor parallelism: the decode hooks' per-request decisions, agreed by every TP rank.

At ``--tp-size N`` each decode TP rank runs its own scheduler, its own Lynx decode side (its own
Mooncake engine, control server and receive arena) and receives its own KV heads' anchor and
residual streams from the prefill rank of the same index. The streams of one request land on the
ranks at different moments, and a stream can fail or time out on one rank only. Every forward is a
collective over the TP group, so the ranks must take every per-request decision in the same
scheduler iteration, or their batches (and the sizes of their collectives) diverge.

Admission on the anchor is agreed by SGLang itself: the Lynx receiver's ``poll`` feeds SGLang's
``poll_and_all_reduce`` (MIN over the TP group's CPU group), so a request enters ``waiting_queue``
on every rank in the same iteration. Every later decision (upgrade at admission, park, verify, the
late-residual fallback, fail) is taken by ``decode.scheduler`` from :func:`agree_on_transport`: once
per scheduler pass each rank lists its view of every request that is still drafting or waiting for
its residual (sorted by rid, the same list on every rank since the previous decisions were agreed),
and one all-reduce over ``scheduler.tp_cpu_group`` makes it common: the residual counts as landed
only when it landed on every rank (MIN), a failure or a missed residual deadline on any rank counts
on all (MAX). "Landed" is ``full_kv_ready``: every stream landed and the full KV that the decode side
prepares off the scheduler thread is ready to install (``transport.inbound``). A sampling request's
uniforms (speculative sampling at verify) come from one seed agreed the same way (:func:`agree_seeds`).
With one rank nothing is exchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_lynx.decode.state import Phase

#: phases in which the decision functions read the transport
UNDECIDED_PHASES = (Phase.DRAFTING, Phase.WAITING_RESIDUAL)
OTHER_RANK_FAILURE = "the residual stream failed on another tensor-parallel rank"


def tp_group_of(scheduler: Any) -> Any | None:
    """The scheduler's TP CPU (gloo) group when it has more than one rank, else None."""
    group = getattr(scheduler, "tp_cpu_group", None)
    if group is None or int(getattr(scheduler, "tp_size", 1) or 1) <= 1:
        return None
    return group


def all_reduce_ints(values: list[int], group: Any, op: str) -> list[int]:
    """``values`` reduced elementwise over ``group`` (``op`` "min" or "max"); unchanged without a group."""
    if group is None or not values:
        return list(values)
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]


def agree_on_transport(scheduler: Any, tracked: list[Any], now: float) -> None:
    """Set ``agreed_landed`` / ``agreed_failed`` / ``agreed_late`` on every request of ``tracked`` that is
    still drafting or waiting for its residual (module docstring). One collective per call (when the
    list is not empty and TP > 1); every rank must call it at the same point with the same requests."""
    ordered = sorted((t for t in tracked if t.state.phase in UNDECIDED_PHASES), key=lambda t: str(t.req.rid))
    if not ordered:
        return
    flags: list[int] = []
    for t in ordered:
        deadline = t.residual_deadline()  # None once the residual really landed here
        # MIN of [landed, -failed, -late] = (landed on all, failed on any, late on any)
        flags += [int(bool(t.progress.full_kv_ready())), -int(t.progress.failure() is not None),
                  -int(deadline is not None and now >= deadline)]
    agreed = all_reduce_ints(flags, tp_group_of(scheduler), "min")
    for i, t in enumerate(ordered):
        t.agreed_landed, t.agreed_failed, t.agreed_late = agreed[3 * i] == 1, agreed[3 * i + 1] < 0, \
            agreed[3 * i + 2] < 0


def agree_seeds(scheduler: Any, seeds: list[int]) -> list[int]:
    """One seed per entry, the same on every rank (the largest proposed)."""
    return all_reduce_ints(seeds, tp_group_of(scheduler), "max")
