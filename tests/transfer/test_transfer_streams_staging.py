"""Pure tier: descriptor framing, remote-metadata validation, staging allocator lifecycle."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_lynx.transfer.staging import LeaseState, StagingAllocator, StagingFullError
from sglang_lynx.transfer.streams import (
    RemoteTarget,
    StreamDescriptor,
    StreamKind,
    StreamRegion,
    TransferMetadataError,
    checksum,
    chunk_spans,
    validate_target,
)

A, R = StreamKind.ANCHOR, StreamKind.RESIDUAL


@given(st.integers(0, 10**6), st.integers(100, 10**6))
@settings(max_examples=200, deadline=None)
def test_chunk_spans_cover_exactly(total: int, chunk: int) -> None:
    spans = chunk_spans(total, chunk)
    assert sum(n for _, n in spans) == total
    assert all(0 < n <= chunk for _, n in spans)
    assert [off for off, _ in spans] == list(range(0, total, chunk))


def test_descriptor_roundtrip_and_rejects_bad_fields() -> None:
    d = StreamDescriptor("req-1", R, 10_000, 4096, checksum(b"x" * 10))
    assert StreamDescriptor.from_dict(d.to_dict()) == d and d.num_chunks == 3
    assert checksum(b"hello") == zlib.crc32(b"hello")
    for bad in ({**d.to_dict(), "total_bytes": -1}, {**d.to_dict(), "chunk_bytes": 0},
                {**d.to_dict(), "kind": "middle"}, {**d.to_dict(), "crc32": 1 << 32},
                {**d.to_dict(), "total_bytes": 1.5}, {k: v for k, v in d.to_dict().items() if k != "crc32"}):
        with pytest.raises(TransferMetadataError):
            StreamDescriptor.from_dict(bad)


def _target(anchor: tuple[int, int], residual: tuple[int, int], arena: tuple[int, int] = (4096, 1 << 20)):
    return RemoteTarget("10.0.0.2:1234", arena[0], arena[1],
                        {A: StreamRegion(*anchor), R: StreamRegion(*residual)})


def test_validate_target_accepts_good_and_rejects_each_bad_field() -> None:
    good = _target((4096, 1000), (8192, 2000))
    validate_target(good, {A: 1000, R: 2000})
    assert RemoteTarget.from_dict(good.to_dict()) == good
    cases = {
        "does not fit": (good, {A: 1001, R: 0}),
        "outside the staging arena": (_target((4096, 1000), ((1 << 20) + 4000, 2000)), {A: 1, R: 1}),
        "overlap": (_target((4096, 5000), (8192, 2000)), {A: 1, R: 1}),
        "out of range": (_target((4096, -5), (8192, 10)), {A: 0, R: 0}),
        "expected an integer": (_target((4096, 10), (8192.0, 10)), {A: 0, R: 0}),  # type: ignore[arg-type]
        "overflows": (_target((4096, 10), (8192, 10), arena=(4096, (1 << 63) - 1)), {A: 0, R: 0}),
        "no region": (RemoteTarget("h:1", 4096, 1 << 20, {A: StreamRegion(4096, 10)}), {A: 1, R: 1}),
        "host:port": (RemoteTarget("nohost", 4096, 1 << 20, {A: StreamRegion(4096, 10)}), {A: 1}),
    }
    for needle, (target, sizes) in cases.items():
        with pytest.raises(TransferMetadataError, match=needle):
            validate_target(target, sizes)
    with pytest.raises(TransferMetadataError, match="missing field"):
        RemoteTarget.from_dict({"session_id": "h:1"})


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_staging_lifecycle_and_quarantine_never_reuses_bytes() -> None:
    clock = Clock()
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64, clock=clock)
    a = alloc.allocate("a", {A: 1000, R: 3000})
    assert a.regions[A].capacity == 1000 and a.regions[R].addr >= a.regions[A].addr + 1000
    validate_target(a.target("h:1"), {A: 1000, R: 3000})
    alloc.allocate("b", {A: 1000, R: 3000})
    with pytest.raises(StagingFullError, match="quarantined"):
        alloc.allocate("c", {A: 1000, R: 3000})
    alloc.quarantine("a", "peer died mid-residual", hold_s=5.0)
    with pytest.raises(StagingFullError, match="1 region"):
        alloc.allocate("c", {A: 1000, R: 3000})  # a's bytes may still be written: not handed out
    with pytest.raises(TransferMetadataError, match="quarantined"):
        alloc.release("a")
    clock.t = 5.0
    c = alloc.allocate("c", {A: 1000, R: 3000})  # the hold expired: reclaimed and reused
    assert c.start == a.start and a.state is LeaseState.FREED
    alloc.quarantine("b", "aborted", hold_s=100.0)
    alloc.sender_quiet("b")  # sender says nothing can land any more: free now
    alloc.release("c")
    assert alloc.free_bytes == 10_000 and alloc.quarantined() == []
    with pytest.raises(TransferMetadataError, match="already holds"):
        alloc.allocate("x", {A: 1}) and alloc.allocate("x", {A: 1})
    with pytest.raises(TransferMetadataError):
        alloc.allocate("y", {A: -1})


def test_staging_quiet_before_failure_frees_at_once_and_stats_show_idle() -> None:
    """The sender said quiet, then the request failed (e.g. aborted after every stream landed): no
    write can still land, so the region is not held for the quarantine time."""
    alloc = StagingAllocator(1 << 20, 10_000, alignment=64, clock=Clock())
    alloc.allocate("a", {A: 1000, R: 3000})
    alloc.allocate("b", {A: 1000})
    assert alloc.stats() == {"arena_bytes": 10_000, "free_bytes": 10_000 - 4032 - 1024, "leases": 2,
                             "quarantined": 0, "waiting": 0, "waits": 0}
    alloc.sender_quiet("a")  # still active: remembered
    assert alloc.lease("a") is not None
    alloc.quarantine("a", "aborted after landing", hold_s=100.0)
    alloc.quarantine("b", "timeout", hold_s=100.0)  # b's sender never said quiet: held
    assert alloc.lease("a") is None and alloc.quarantined() == ["b"]
    assert alloc.stats()["quarantined"] == 1
    alloc.sender_quiet("b")
    assert alloc.stats() == {"arena_bytes": 10_000, "free_bytes": 10_000, "leases": 0, "quarantined": 0,
                             "waiting": 0, "waits": 0}


@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.sampled_from(["release", "q"])),
                min_size=1, max_size=30))
@settings(max_examples=100, deadline=None)
def test_staging_regions_never_overlap_live_or_quarantined(ops: list[tuple[int, int, str]]) -> None:
    clock = Clock()
    alloc = StagingAllocator(4096, 20_000, alignment=64, clock=clock)
    live: dict[str, tuple[int, int]] = {}
    held: set[str] = set()  # quarantined: their bytes may still be written
    for i, (na, nr, how) in enumerate(ops):
        try:
            lease = alloc.allocate(f"r{i}", {A: na, R: nr})
        except StagingFullError:
            active = [r for r in live if r not in held]
            if not active:  # only quarantined regions left: let their hold expire
                clock.t += 2.0
                alloc.reclaim_expired()
                for r in held:
                    del live[r]
                held.clear()
            elif how == "release":
                alloc.release(active[0])
                del live[active[0]]
            else:
                alloc.quarantine(active[0], "x", 1.0)
                held.add(active[0])
            continue
        span = (lease.start, lease.start + lease.length)
        for other in live.values():  # quarantined regions stay in `live`: they must not be reused
            assert span[1] <= other[0] or other[1] <= span[0]
        live[f"r{i}"] = span
        assert span[0] >= 4096 and span[1] <= 4096 + 20_000
