"""Layer groups (``transport.prefill_layers``) through the real transport (both sides, real Mooncake and
control channel on loopback, no SGLang): the forward's layer hooks are driven as SGLang's would be. A
group's part goes on the wire before the forward writes the next layer and before SGLang hands the chunk
over; the decode pool ends byte for byte where the whole-request transfer puts it; a chunk handed over
from other slots than the forward wrote is refused and frees both arenas."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from test_transport_streamed import TOKENS, Pair, _transfer
from transport_testlib import poll_until_final, wait_idle

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.arena import KVShape, stream_sizes
from sglang_lynx.integration.transport.decode_side import Verdict
from sglang_lynx.integration.transport.pages import token_slots
from sglang_lynx.integration.transport.prefill_layers import ChunkInForward
from sglang_lynx.transfer.staging import StagingFullError
from sglang_lynx.transfer.streams import StreamKind

pytestmark = pytest.mark.timeout(300)
CODEC_PAGE = 64
ROOM = 11  # the room of test_transport_streamed._transfer: the same source slots


def _wait_for_issue(pair: Pair, bound_s: float = 30.0, kind: StreamKind | None = None) -> int:
    """Writes issued so far once there is one (of ``kind``), 0 when none came within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        log = list(pair.prefill.scheduler.issue_log)
        if log and (kind is None or any(k is kind for _, k, _ in log)):
            return len(log)
        time.sleep(0.01)
    return 0


def _layered(mode: str, page_size: int, hooks: bool = True, cached: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """The decode's request rows after a layered transfer, and how many writes were issued when the
    forward of the first chunk had written only layer 0 (``cached``: the first forward starts after that
    many tokens, a radix-cached prefix already in the pool)."""
    config = LynxConfig(mode=mode, page_tokens=CODEC_PAGE, stream_layer_group=1,
                        **({"kivi_recent_tokens": 32} if mode.startswith("kivi") else {}))
    pair = Pair(config, page_size)
    try:
        manager, src, dst = pair.start(ROOM)
        early, at = [], 0
        for chunk in pair.chunks(len(dst)):
            slots = token_slots(src[chunk], page_size)[: TOKENS - at]
            # layer 1 is not computed yet: what a part reads of it now is garbage
            fresh = slots[cached:] if at == 0 else slots  # a cached prefix is in the pool already
            k1, v1 = pair.k_src[1][fresh].clone(), pair.v_src[1][fresh].clone()
            pair.k_src[1][fresh], pair.v_src[1][fresh] = float("nan"), float("nan")
            skip = cached if at == 0 else 0
            chunk_in = ChunkInForward(ROOM, at + skip, slots[skip:], slots[:skip] if skip else None)
            forward = pair.prefill.begin_forward(manager, [chunk_in])
            assert forward is not None
            if hooks:
                pair.prefill.layers_written(forward, 1)
                if at == 0:
                    early.append(_wait_for_issue(pair))
                    if mode == "lynx-exact":  # layer 0's exact piece too, before layer 1 is written
                        early.append(_wait_for_issue(pair, kind=StreamKind.EXACT))
            pair.k_src[1][fresh], pair.v_src[1][fresh] = k1, v1
            if hooks:
                pair.prefill.layers_written(forward, 2)
            pair.prefill.end_forward(forward)
            assert pair.prefill.send_kvcache(manager, "s", src[chunk], dst[chunk]) == 0
            at += int(slots.numel())
        assert pair.failures == []
        assert pair.prefill.snapshot()["requests_layered"] == 1
        pair.decode.arm(ROOM)
        assert poll_until_final(pair.decode, ROOM, need_residual=False)[0] is Verdict.DONE
        assert poll_until_final(pair.decode, ROOM, need_residual=True)[0] is Verdict.DONE
        rows = token_slots(dst, page_size, TOKENS)
        got = [x[rows].clone() for x in pair.k_dst + pair.v_dst]
        wait_idle(pair.prefill, pair.decode)
        return got, early
    finally:
        pair.close()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["lynx", "lynx-exact", "int8", "bf16"])
def test_a_layered_request_lands_the_same_kv_as_a_whole_one(mode: str, page_size: int) -> None:
    layered, early = _layered(mode, page_size)
    whole, source, _, _ = _transfer(mode, page_size, stream=False)
    assert early and early[0] > 0, "nothing went on the wire while the forward was in its later layers"
    if mode == "lynx-exact":
        assert early[1] > 0, "no exact byte went on the wire while the forward was in its later layers"
    for a, b in zip(layered, whole, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    if mode in ("lynx-exact", "bf16"):
        for a, b in zip(layered, source, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_cached_prefix_goes_with_the_first_group() -> None:
    layered, early = _layered("lynx", 1, cached=70)
    whole, _, _, _ = _transfer("lynx", 1, stream=False)
    assert early and early[0] > 0
    for a, b in zip(layered, whole, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_forward_whose_layers_no_hook_saw_is_taken_whole_at_its_end() -> None:
    layered, _ = _layered("lynx", 1, hooks=False)
    whole, _, _, _ = _transfer("lynx", 1, stream=False)
    for a, b in zip(layered, whole, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_chunk_handed_over_from_other_slots_is_refused_and_frees_both_arenas() -> None:
    pair = Pair(LynxConfig(mode="lynx", page_tokens=CODEC_PAGE, stream_layer_group=1), 1)
    try:
        manager, src, dst = pair.start(22)
        first, second, _ = pair.chunks(len(dst))
        forward = pair.prefill.begin_forward(manager, [ChunkInForward(22, 0, token_slots(src[first], 1))])
        assert forward is not None
        pair.prefill.layers_written(forward, 2)
        pair.prefill.end_forward(forward)
        pair.decode.arm(22)
        assert pair.prefill.send_kvcache(manager, "s", src[second], dst[first]) == -1  # not what was written
        assert any("other KV slots" in why for why in pair.failures), pair.failures
        pair.prefill.on_room_failed(manager, 22)  # what SGLang does with a failed chunk
        verdict, _why = poll_until_final(pair.decode, 22, need_residual=False)
        assert verdict is Verdict.FAILED
        pair.decode.abort(22)
        wait_idle(pair.prefill, pair.decode)
        assert pair.prefill.snapshot()["streamed_requests"] == 0
    finally:
        pair.close()


def test_a_request_without_its_prefix_slots_or_a_free_region_now_is_not_layered() -> None:
    pair = Pair(LynxConfig(mode="lynx", page_tokens=CODEC_PAGE, stream_layer_group=1), 1)
    try:
        manager, src, _dst = pair.start(23)
        slots = token_slots(src, 1)
        assert pair.prefill.begin_forward(manager, [ChunkInForward(23, 64, slots[64:128])]) is None  # prefix unknown
        # its chunk was computed without layers: its send_kvcache takes a region first, even its own later chunk
        assert pair.prefill.begin_forward(manager, [ChunkInForward(23, 0, slots[:128])]) is None
        pair.prefill.on_room_failed(manager, 23)  # SGLang failed it: nothing of it will be sent
        sizes = stream_sizes(pair.prefill.codec, KVShape.of_pool(pair.prefill.k_pool), TOKENS)
        held = []
        with pytest.raises(StagingFullError):
            for i in range(1000):
                pair.prefill.send_alloc.allocate(f"other-{i}", sizes)
                held.append(f"other-{i}")
        other, src2, _ = pair.start(25)
        chunk = ChunkInForward(25, 0, token_slots(src2, 1)[:128])
        assert pair.prefill.begin_forward(other, [chunk]) is None  # no region free now
        for request_id in held:
            pair.prefill.send_alloc.release(request_id)
        assert pair.prefill.begin_forward(other, [chunk]) is None  # again: its own first send goes first
        pair.prefill.on_room_failed(other, 25)
        third, src3, _ = pair.start(26)
        forward = pair.prefill.begin_forward(third, [ChunkInForward(26, 0, token_slots(src3, 1)[:128])])
        assert forward is not None and pair.prefill.snapshot()["requests_layered"] == 1
        pair.prefill.end_forward(forward, completed=False)
        pair.prefill.on_room_failed(third, 26)
        for room in (23, 25, 26):
            pair.decode.abort(room)
        wait_idle(pair.prefill, pair.decode)
    finally:
        pair.close()


def _last_token_apart(chunks: list[slice]) -> list[slice]:
    """``chunks`` with the request's last token as a chunk of its own: a prompt the radix cache held whole,
    of which SGLang recomputes only the last token."""
    last = chunks[-1]
    return [*chunks[:-1], slice(last.start, last.stop - 1), slice(last.stop - 1, last.stop)]


def test_a_last_token_handed_over_from_a_radix_cached_slot_is_sent_from_there() -> None:
    """SGLang's radix cache maps a recomputed last token to the slot of its cached copy before handing the
    chunk over; the decode gets that slot's KV (what stock SGLang sends), here made to differ. The forward
    of that token computed only it (the cache held the whole prompt), so its page waited for the last part."""
    pair = Pair(LynxConfig(mode="lynx-exact", page_tokens=CODEC_PAGE, stream_layer_group=1), 1)
    try:
        manager, src, dst = pair.start(24)
        for x in pair.k_src + pair.v_src:
            x[0] = -x[0] + 0.25  # slot 0 (no token of the request): the cached copy, other KV
        chunks, at = _last_token_apart(pair.chunks(len(dst))), 0
        for i, chunk in enumerate(chunks):
            slots = token_slots(src[chunk], 1)[: TOKENS - at]
            forward = pair.prefill.begin_forward(manager, [ChunkInForward(24, at, slots)])
            assert forward is not None
            pair.prefill.layers_written(forward, 2)
            pair.prefill.end_forward(forward)
            handed = src[chunk].copy()
            if i == len(chunks) - 1:
                handed[-1] = 0
            assert pair.prefill.send_kvcache(manager, "s", handed, dst[chunk]) == 0
            at += int(slots.numel())
        assert pair.failures == []
        pair.decode.arm(24)
        assert poll_until_final(pair.decode, 24, need_residual=True)[0] is Verdict.DONE
        want = token_slots(src, 1, TOKENS).clone()
        want[-1] = 0
        rows = token_slots(dst, 1, TOKENS)
        for got, source in zip(pair.k_dst + pair.v_dst, pair.k_src + pair.v_src, strict=True):
            assert torch.equal(got[rows].view(torch.int16), source[want].view(torch.int16))
        wait_idle(pair.prefill, pair.decode)
    finally:
        pair.close()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("last_alone", "stream_last_page"), [(False, True), (True, True), (False, False)],
                         ids=["long-last-forward", "last-token-alone", "switched-off"])
def test_a_forward_of_the_last_token_and_more_sends_the_last_page_with_its_layers(
        page_size: int, last_alone: bool, stream_last_page: bool) -> None:
    """A forward that computes the request's last token and more than one SGLang page of it takes each layer
    group to the end (partial last page, trailers) as it is written; a forward of the last token (page) alone,
    which SGLang may hand over from a radix-cached copy, leaves that page to the last part (as every forward
    does with ``stream_last_page: false``). Either way the decode gets the prefill's KV bit for bit."""
    pair = Pair(LynxConfig(mode="lynx-exact", page_tokens=CODEC_PAGE, stream_layer_group=1,
                           stream_last_page=stream_last_page), page_size)
    try:
        manager, src, dst = pair.start(31)
        chunks, at = pair.chunks(len(dst)), 0
        if last_alone:
            chunks = _last_token_apart(chunks)
        for i, chunk in enumerate(chunks):
            slots = token_slots(src[chunk], page_size)[: TOKENS - at]
            forward = pair.prefill.begin_forward(manager, [ChunkInForward(31, at, slots)])
            assert forward is not None
            pair.prefill.layers_written(forward, 1)
            pair.prefill.layers_written(forward, 2)
            if i == len(chunks) - 1:  # what the groups queued: through the last page, or all but its page
                streamed = pair.prefill._streamed[31]
                full = (TOKENS - 1) // streamed.parts.page
                assert streamed.queued_pages == (streamed.parts.pages if stream_last_page and not last_alone else full)
            pair.prefill.end_forward(forward)
            assert pair.prefill.send_kvcache(manager, "s", src[chunk], dst[chunk]) == 0
            at += int(slots.numel())
        assert pair.failures == []
        pair.decode.arm(31)
        assert poll_until_final(pair.decode, 31, need_residual=True)[0] is Verdict.DONE
        got, want = token_slots(dst, page_size, TOKENS), token_slots(src, page_size, TOKENS)
        for a, b in zip(pair.k_dst + pair.v_dst, pair.k_src + pair.v_src, strict=True):
            assert torch.equal(a[got].view(torch.int16), b[want].view(torch.int16))
        wait_idle(pair.prefill, pair.decode)
    finally:
        pair.close()


def test_a_request_computed_earlier_takes_its_region_first() -> None:
    """A request computed without layers whose send_kvcache has not run yet goes first: a layered request
    taking a region before it could leave it waiting in the transfer worker in front of the layered
    request's own last chunk (the deadlock the back-pressure test found)."""
    pair = Pair(LynxConfig(mode="lynx", page_tokens=CODEC_PAGE, stream_layer_group=1), 1)
    try:
        first, src1, dst1 = pair.start(31)
        second, src2, dst2 = pair.start(32)
        pair.prefill.test_faults[31] = "per_chunk"  # computed without layers
        assert pair.prefill.begin_forward(first, [ChunkInForward(31, 0, token_slots(src1, 1))]) is None
        probe, src_probe, _ = pair.start(30)
        chunk = ChunkInForward(30, 0, token_slots(src_probe, 1))
        assert pair.prefill.begin_forward(probe, [chunk]) is None  # 31's send_kvcache has not run
        pair.prefill.on_room_failed(probe, 30)  # (computed without layers: its own send would go first)
        assert pair.prefill.send_kvcache(first, "s", src1, dst1) == 0  # 31 takes its region
        forward = pair.prefill.begin_forward(second, [ChunkInForward(32, 0, token_slots(src2, 1))])
        assert forward is not None
        pair.prefill.layers_written(forward, 2)
        pair.prefill.end_forward(forward)
        assert pair.prefill.send_kvcache(second, "s", src2, dst2) == 0
        assert pair.failures == []
        for room in (31, 32):
            pair.decode.arm(room)
            assert poll_until_final(pair.decode, room, need_residual=True)[0] is Verdict.DONE
        pair.decode.abort(30)
        wait_idle(pair.prefill, pair.decode)
    finally:
        pair.close()


def test_a_pool_off_the_cpu_is_not_layered_and_the_log_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Layer groups copy rows on the forward's thread while the device may still be writing them: a KV
    pool off the CPU (here the ``meta`` device standing in for CUDA) streams per chunk, and start-up says so."""
    from sglang_lynx.integration.transport.prefill_side import LynxPrefillSide

    side = LynxPrefillSide(LynxConfig(mode="lynx", page_tokens=CODEC_PAGE, stream_layer_group=5), "127.0.0.1")
    try:
        pool = [torch.empty(TOKENS + 1, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(2)]
        with caplog.at_level(logging.WARNING, logger="sglang_lynx.transport"):
            side.attach_pool(pool, [x.clone() for x in pool], pool_tokens=TOKENS + 1, max_request_tokens=TOKENS)
        assert "stream_layer_group=5 applies to CPU KV pools only; this meta pool streams" in caplog.text
        chunk = ChunkInForward(ROOM, 0, torch.arange(1, 129))
        assert side.begin_forward(SimpleNamespace(transfer_infos={}), [chunk]) is None
    finally:
        side.close()
