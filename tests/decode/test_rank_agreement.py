"""``decode.rank_agreement`` over a real two-rank gloo group (two processes, no server): every rank ends up
with the same view of each request whatever its own transport says, and the same sampling seeds.

The transport states are fakes (what each rank's Lynx decode side would report); the collective is
``torch.distributed`` on gloo, as SGLang's TP CPU group is on this host.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp

from sglang_lynx.config import LynxConfig
from sglang_lynx.decode.state import LynxRequestState, Phase

# per rank, per rid: (residual landed, failure, anchor landed at); a rid absent from UNDECIDED is NORMAL
VIEWS: dict[int, dict[str, tuple[bool, str | None, float]]] = {
    0: {"a": (True, None, 100.0), "b": (True, None, 100.0), "c": (False, None, 100.0), "d": (False, None, 0.0),
        "e": (False, None, 100.0)},
    1: {"a": (True, None, 100.0), "b": (False, None, 100.0), "c": (False, "checksum mismatch", 100.0),
        "d": (True, None, 100.0), "e": (False, None, 100.0)},
}
NOW = 110.0  # residual_timeout_s 20: late only where the anchor landed at 0.0 (deadline 20, not 120) and the
# residual has not landed on that rank (a residual that landed is never late: Tracked.residual_deadline)
# rid -> (landed on every rank, failed on some rank, late on some rank)
EXPECTED = {"a": (True, False, False), "b": (False, False, False), "c": (False, True, False),
            "d": (False, False, True), "e": (False, False, False)}


class _Progress:
    def __init__(self, landed: bool, failure: str | None, prepared: bool = True) -> None:
        self.landed, self.error, self.prepared = landed, failure, prepared

    def residual_landed(self) -> bool:
        return self.landed

    def full_kv_ready(self) -> bool:  # as InboundProgress: landed, and its prepared upgrade (if any) done
        return self.landed and self.prepared

    def failure(self) -> str | None:
        return self.error


def _tracked(rank: int) -> list[Any]:
    from sglang_lynx.integration.decode.tracked import Tracked

    config = LynxConfig(mode="lynx", residual_timeout_s=20.0)
    out = []
    for rid in ("e", "d", "c", "b", "a", "z"):  # an order that is not sorted: the ranks must sort
        state = LynxRequestState(rid=rid, config=config)
        if rid == "z":
            state.phase = Phase.NORMAL  # decided already: not exchanged
            out.append(Tracked(SimpleNamespace(rid=rid), 0, _Progress(False, None), state, True))
            continue
        landed, failure, anchor_at = VIEWS[rank][rid]
        state.on_anchor_admitted(1, anchor_at)
        out.append(Tracked(SimpleNamespace(rid=rid), 0, _Progress(landed, failure), state, True))
    return out


def _worker(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from sglang_lynx.integration.decode.rank_agreement import agree_on_transport, agree_seeds

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        scheduler = SimpleNamespace(tp_cpu_group=group, tp_size=2)
        tracked = _tracked(rank)
        agree_on_transport(scheduler, tracked, NOW)
        view = {t.req.rid: (t.agreed_landed, t.agreed_failed, t.agreed_late) for t in tracked if t.req.rid != "z"}
        failures = {t.req.rid: t.failure() for t in tracked if t.req.rid != "z"}
        seeds = agree_seeds(scheduler, [rank * 10 + 1, 7 - rank])
        results.put((rank, view, failures, seeds))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(300)
def test_two_gloo_ranks_agree_on_landed_failed_late_and_seeds() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, view, failures, seeds = results.get(timeout=240)
        got[rank] = (view, failures, seeds)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        view, failures, seeds = got[rank]
        assert view == EXPECTED, (rank, view)
        assert seeds == [11, 7], (rank, seeds)
    # the failure reason: this rank's own when it has one, else a reason naming the other rank
    assert got[1][1]["c"] == "checksum mismatch"
    assert "another tensor-parallel rank" in got[0][1]["c"]
    assert got[0][1]["a"] is None and got[1][1]["a"] is None


def test_one_rank_needs_no_group() -> None:
    from sglang_lynx.integration.decode.rank_agreement import agree_on_transport, agree_seeds, tp_group_of

    scheduler = SimpleNamespace(tp_cpu_group=object(), tp_size=1)
    assert tp_group_of(scheduler) is None and tp_group_of(SimpleNamespace()) is None
    tracked = _tracked(1)
    agree_on_transport(scheduler, tracked, NOW)  # no collective: this rank's own view
    view = {t.req.rid: (t.agreed_landed, t.agreed_failed, t.agreed_late) for t in tracked if t.req.rid != "z"}
    assert view == {"a": (True, False, False), "b": (False, False, False), "c": (False, True, False),
                    "d": (True, False, False), "e": (False, False, False)}
    assert agree_seeds(scheduler, [5, 6]) == [5, 6]


def test_a_landed_residual_whose_upgrade_is_still_being_prepared_is_neither_landed_nor_late() -> None:
    from sglang_lynx.integration.decode.rank_agreement import agree_on_transport
    from sglang_lynx.integration.decode.tracked import Tracked

    state = LynxRequestState(rid="p", config=LynxConfig(mode="lynx", residual_timeout_s=20.0))
    state.on_anchor_admitted(1, 0.0)  # deadline 20 s, long past at NOW
    progress = _Progress(True, None, prepared=False)
    tracked = Tracked(SimpleNamespace(rid="p"), 0, progress, state, True)
    agree_on_transport(SimpleNamespace(tp_size=1), [tracked], NOW)
    assert (tracked.agreed_landed, tracked.agreed_failed, tracked.agreed_late) == (False, False, False)
    progress.prepared = True
    agree_on_transport(SimpleNamespace(tp_size=1), [tracked], NOW)
    assert tracked.agreed_landed and not tracked.agreed_late
