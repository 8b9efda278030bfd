"""``lynx-exact`` through the real transport (both sides, real Mooncake and control channel on loopback,
no SGLang): the decode's pool after the three streams is the prefill's BF16 KV bit for bit, at page
sizes 1 and 64, with the sink token, a partial last page, a constant page, +-0 and subnormals; an exact
stream that would not fit its region is not sent and the request fails with the reason after its
anchor landed (the decode hooks then take the recompute fallback). Also here, for ``lynx`` and
``lynx-exact``: the residual on the wire leaves out what the anchor's trailer carries
(``codec.wire_residual``) and the pool still gets lynx's 8-bit reconstruction byte for byte; two prefill sides
sending to one decode side at once (xPyD at the transport) each land their own KV bit for bit; ``lynx-exact``'s
full upgrade prepared off the scheduler thread (``InboundProgress.prepare_full``) writes exactly what
the in-place decode writes, only into the request's slots, one whose preparation failed is decoded in
place, and ``lynx`` prepares nothing (its upgrade is decoded in place)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transport_testlib import poll_until_final, wait_idle

from sglang_lynx.codec import exact_request
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.decode_side import LynxDecodeSide, Verdict
from sglang_lynx.integration.transport.pages import pages_for, token_slots
from sglang_lynx.integration.transport.prefill_side import LynxPrefillSide
from sglang_lynx.integration.transport.wire import parse_field
from sglang_lynx.transfer.streams import StreamKind

pytestmark = pytest.mark.timeout(300)
LAYERS, HEADS, DIM = 3, 3, 64


def _pool_pages(page_size: int, tokens: int) -> int:
    return 2 * pages_for(tokens, page_size) + 3


def _source_pool(pool_pages: int, page_size: int, seed: int) -> list[torch.Tensor]:
    """BF16 KV with the values the exact stream must get right (pool page 0 is SGLang's padding)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        x = torch.randn((pool_pages + 1) * page_size, HEADS, DIM, generator=g) * 0.3
        x[5:9] = 0.0
        x[5:7, :, ::2] = -0.0
        x[9, :, :16] = 1e-39  # subnormal in BF16
        x[9, :, 16:32] = -3e-40
        x[2 * page_size: 3 * page_size] = 1.5  # a constant page
        layers.append(x.bfloat16())
    return layers


def _pair(tmp_config: LynxConfig, page_size: int, tokens: int):  # noqa: ANN202
    prefill, decode = LynxPrefillSide(tmp_config, "127.0.0.1"), LynxDecodeSide(tmp_config, "127.0.0.1")
    pool_pages = _pool_pages(page_size, tokens)
    k_src, v_src = _source_pool(pool_pages, page_size, 1), _source_pool(pool_pages, page_size, 2)
    prefill.attach_pool(k_src, v_src, pool_tokens=pool_pages * page_size, max_request_tokens=tokens,
                        page_size=page_size)
    k_dst = [torch.zeros_like(x) for x in k_src]
    v_dst = [torch.zeros_like(x) for x in v_src]
    decode.attach_pool(k_dst, v_dst, pool_tokens=pool_pages * page_size, max_request_tokens=tokens,
                       page_size=page_size)
    return prefill, decode, (k_src, v_src), (k_dst, v_dst)


def _send(prefill: LynxPrefillSide, decode: LynxDecodeSide, room: int, page_size: int, tokens: int,
          dst_pages: np.ndarray | None = None, source: str = "prefill:1") -> tuple:
    n_pages, pool_pages = pages_for(tokens, page_size), _pool_pages(page_size, tokens)
    # the source covers the special rows (tokens 5-9, the constant page 2) early, in a shuffled order
    src_pages = 1 + np.random.default_rng(room).permutation(pool_pages)[:n_pages]
    if page_size > 1:
        src_pages[:2] = [2, 0]  # page 0 holds the special tokens 5-9, page 2 is constant
    if dst_pages is None:
        dst_pages = np.array([pool_pages - i for i in range(n_pages)])
    assert decode.expect(room, dst_pages, source, page_size=page_size, tokens=tokens) is True
    metadata = parse_field([decode.metadata_field(room)])
    registration = parse_field([decode.registration_field()])
    info = SimpleNamespace(is_dummy=False, dst_kv_indices=dst_pages, decode_prefix_len=0, mooncake_session_id="s",
                           lynx=metadata)
    failures: list[str] = []
    manager = SimpleNamespace(transfer_infos={room: {"s": info}}, record_failure=lambda r, why: failures.append(why),
                              decode_kv_args_table={"s": SimpleNamespace(lynx=registration)})
    half = max(1, n_pages // 2)  # two chunks, as a chunked prefill hands them over
    assert prefill.send_kvcache(manager, "s", src_pages[:half], dst_pages[:half]) == 0
    if half < n_pages:
        assert prefill.send_kvcache(manager, "s", src_pages[half:], dst_pages[half:]) == 0
    assert failures == []
    decode.arm(room)
    return token_slots(src_pages, page_size, tokens), token_slots(dst_pages, page_size, tokens)




@pytest.mark.parametrize(("page_size", "tokens", "threads"), [(1, 300, 1), (64, 300, 1), (64, 300, 3)])
def test_the_decode_pool_is_the_prefill_kv_bit_for_bit(page_size: int, tokens: int, threads: int) -> None:
    """... with the exact pieces coded on the calling thread or on ``exact_threads`` pooled ones (both ends)."""
    config = LynxConfig(mode="lynx-exact", exact_threads=threads)
    prefill, decode, (k_src, v_src), (k_dst, v_dst) = _pair(config, page_size, tokens)
    try:
        src, dst = _send(prefill, decode, 7, page_size, tokens)
        assert poll_until_final(decode, 7, need_residual=False)[0] is Verdict.DONE  # admitted on the anchor
        progress = decode.inbound[7]
        assert progress.anchor_decoded and not progress.full_decoded
        anchor_only = k_dst[0][dst].clone()
        assert not torch.equal(anchor_only.view(torch.int16), k_src[0][src].view(torch.int16))  # lossy so far
        assert poll_until_final(decode, 7, need_residual=True)[0] is Verdict.DONE
        for src_pool, dst_pool in ((k_src, k_dst), (v_src, v_dst)):
            for a, b in zip(src_pool, dst_pool, strict=True):
                assert torch.equal(b[dst].view(torch.int16), a[src].view(torch.int16))
        untouched = torch.ones(k_dst[0].shape[0], dtype=torch.bool)
        untouched[dst] = False
        assert bool((k_dst[0][untouched].view(torch.int16) == 0).all())  # nothing outside the request's slots
        wait_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("page_size", [1, 64])
def test_two_prefills_streaming_to_one_decode_at_once_each_land_their_kv_bit_for_bit(page_size: int) -> None:
    """xPyD at the transport (2P1D): two prefill sides, each with its own Mooncake engine and BF16 KV, send one
    request each to one decode side, back to back before the decode polls either (it tracks both at once:
    ``peak_peers_at_once`` 2); each request's slots end as its own prefill's KV bit for bit, no other slot is
    touched, and all three sides go idle."""
    tokens = 300
    config = LynxConfig(mode="lynx-exact")
    first, decode, (k_src, v_src), (k_dst, v_dst) = _pair(config, page_size, tokens)
    second = LynxPrefillSide(config, "127.0.0.1")
    pool_pages = _pool_pages(page_size, tokens)
    k_two, v_two = _source_pool(pool_pages, page_size, 3), _source_pool(pool_pages, page_size, 4)
    try:
        second.attach_pool(k_two, v_two, pool_tokens=pool_pages * page_size, max_request_tokens=tokens,
                           page_size=page_size)
        n_pages = pages_for(tokens, page_size)
        one = _send(first, decode, 7, page_size, tokens)  # the decode pool's last pages
        two = _send(second, decode, 8, page_size, tokens, dst_pages=np.arange(1, n_pages + 1), source="prefill:2")
        assert not set(one[1].tolist()) & set(two[1].tolist())
        for room in (7, 8):
            assert poll_until_final(decode, room, need_residual=True)[0] is Verdict.DONE
        for (src, dst), (k_from, v_from) in ((one, (k_src, v_src)), (two, (k_two, v_two))):
            for src_pool, dst_pool in ((k_from, k_dst), (v_from, v_dst)):
                for a, b in zip(src_pool, dst_pool, strict=True):
                    assert torch.equal(b[dst].view(torch.int16), a[src].view(torch.int16))
        untouched = torch.ones(k_dst[0].shape[0], dtype=torch.bool)
        untouched[one[1]] = False
        untouched[two[1]] = False
        assert bool((k_dst[0][untouched].view(torch.int16) == 0).all())
        peers = decode.snapshot()["received_from"]
        assert peers["requests"] == {"prefill:1": 1, "prefill:2": 1} and peers["peak_peers_at_once"] == 2, peers
        wait_idle(first, decode)
        wait_idle(second, decode)
    finally:
        first.close()
        second.close()
        decode.close()


def test_an_exact_stream_larger_than_its_region_is_not_sent_and_fails_the_request_after_its_anchor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact_request, "EXACT_CAPACITY_BITS", 0)  # both sides: a region of headers only
    monkeypatch.setattr(exact_request, "PIECE_OVERHEAD_BYTES", 16)
    prefill, decode, _, _ = _pair(LynxConfig(mode="lynx-exact"), 1, 200)
    try:
        _send(prefill, decode, 3, 1, 200)
        assert poll_until_final(decode, 3, need_residual=False)[0] is Verdict.DONE
        verdict, why = poll_until_final(decode, 3, need_residual=True)
        assert verdict is Verdict.FAILED and "exact" in why and "exceeds the decode's region" in why, why
        wait_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()




def test_stream_sizes_reserve_the_exact_capacity_in_lynx_exact_only() -> None:
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.integration.transport.arena import KVShape, stream_sizes

    shape = KVShape(LAYERS, HEADS, DIM)
    exact = stream_sizes(get_codec("lynx-exact"), shape, 100)
    lynx = stream_sizes(get_codec("lynx"), shape, 100)
    assert set(lynx) == {StreamKind.ANCHOR, StreamKind.RESIDUAL}
    assert {k: v for k, v in exact.items() if k is not StreamKind.EXACT} == lynx
    assert exact[StreamKind.EXACT] == exact_request.exact_request_capacity(LAYERS, 100, HEADS, DIM, 256)


def test_the_middle_stage_puts_the_8bit_kv_in_the_pool_until_the_exact_stream_lands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.integration.transport import prefill_buffered, prefill_streaming

    release = threading.Event()

    def holding(make: Any) -> Any:
        def held(*args: Any, **kwargs: Any) -> Any:
            assert release.wait(60)
            return make(*args, **kwargs)
        return held

    # the request below is streamed (two chunks): its exact encode starts with its writer
    monkeypatch.setattr(prefill_buffered, "encode_exact_stream", holding(prefill_buffered.encode_exact_stream))
    monkeypatch.setattr(prefill_streaming, "exact_stream_writer", holding(prefill_streaming.exact_stream_writer))
    config = LynxConfig(mode="lynx-exact")
    prefill, decode, (k_src, v_src), (k_dst, _) = _pair(config, 1, 200)
    try:
        src, dst = _send(prefill, decode, 5, 1, 200)
        assert poll_until_final(decode, 5, need_residual=False)[0] is Verdict.DONE
        progress = decode.inbound[5]
        deadline = time.monotonic() + 60
        while not progress.upgrade_to_residual():
            assert time.monotonic() < deadline, "the residual never landed"
            time.sleep(0.01)
        assert progress.residual_decoded and not progress.full_decoded
        assert progress.upgrade_to_residual() is False  # once
        codec = get_codec(config.codec_name, **config.codec_params())
        want = codec.decode(codec.encode(k_src[1][src], "k", layer=1), with_residual=True, dtype=torch.bfloat16)
        assert torch.equal(k_dst[1][dst].view(torch.int16), want.view(torch.int16))  # lynx's 8-bit KV
        assert decode.poll(5, need_residual=True)[0] is Verdict.PENDING  # the exact stream is held
        release.set()
        assert poll_until_final(decode, 5, need_residual=True)[0] is Verdict.DONE
        assert torch.equal(k_dst[1][dst].view(torch.int16), k_src[1][src].view(torch.int16))
        wait_idle(prefill, decode)
    finally:
        release.set()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("page_size", [1, 64])
def test_the_residual_on_the_wire_leaves_out_the_trailer_and_the_pool_gets_the_8bit_kv(page_size: int) -> None:
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.codec.request import request_stream_bytes
    from sglang_lynx.codec.wire_residual import residual_wire_bytes

    config, tokens = LynxConfig(mode="lynx"), 300
    codec = get_codec(config.codec_name, **config.codec_params())
    prefill, decode, (k_src, v_src), (k_dst, v_dst) = _pair(config, page_size, tokens)
    try:
        src, dst = _send(prefill, decode, 6, page_size, tokens)
        sent = decode.inbound[6].sizes[StreamKind.RESIDUAL]  # what the decode reserved and receives
        assert poll_until_final(decode, 6, need_residual=True)[0] is Verdict.DONE
        whole = request_stream_bytes(codec, LAYERS, tokens, HEADS, DIM)[1]
        tails = 2 * LAYERS * 48 * HEADS * DIM // 2  # K and V of each layer: the last 48 tokens, 4 bits
        assert sent == residual_wire_bytes(codec, LAYERS, tokens, HEADS, DIM) == whole - tails
        for kind, src_pool, dst_pool in (("k", k_src, k_dst), ("v", v_src, v_dst)):
            for layer, (a, b) in enumerate(zip(src_pool, dst_pool, strict=True)):
                want = codec.decode(codec.encode(a[src], kind, layer=layer), with_residual=True, dtype=torch.bfloat16)
                assert torch.equal(b[dst].view(torch.int16), want.view(torch.int16)), (kind, layer)
        wait_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_the_middle_stage_and_the_prepared_upgrade_are_lynx_exact_only() -> None:
    prefill, decode, _, _ = _pair(LynxConfig(mode="lynx"), 1, 50)
    try:
        _send(prefill, decode, 4, 1, 50)
        assert poll_until_final(decode, 4, need_residual=False)[0] is Verdict.DONE
        time.sleep(0.2)
        progress = decode.inbound[4]
        assert progress.upgrade_to_residual() is False
        _landed(progress)
        decode._prepare_if_complete("4")  # lynx's upgrade is decoded in place, by the verify
        assert progress.prepared is None and progress.full_kv_ready()
        assert poll_until_final(decode, 4, need_residual=True)[0] is Verdict.DONE
    finally:
        prefill.close()
        decode.close()


def _prepared(decode: LynxDecodeSide, progress: Any, room: int, bound_s: float = 60.0) -> None:
    """Once every stream landed, start the upgrade as the control thread does and wait until it is ready."""
    _landed(progress, bound_s)
    decode._prepare_if_complete(str(room))  # what the control thread does on the last landed notice
    assert progress.prepared is not None
    deadline = time.monotonic() + bound_s
    while not progress.full_kv_ready():
        assert time.monotonic() < deadline, "the prepared upgrade never finished"
        time.sleep(0.01)


def _landed(progress: Any, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not progress.residual_landed():
        assert time.monotonic() < deadline, "the last stream never landed"
        time.sleep(0.01)


@pytest.mark.parametrize("page_size", [1, 64])
def test_the_upgrade_prepared_off_the_scheduler_thread_writes_what_the_in_place_decode_writes(page_size: int) -> None:
    tokens, mode = 300, "lynx-exact"
    prefill, decode, (k_src, v_src), (k_dst, v_dst) = _pair(LynxConfig(mode=mode), page_size, tokens)
    try:
        src, dst = _send(prefill, decode, 8, page_size, tokens)
        assert poll_until_final(decode, 8, need_residual=False)[0] is Verdict.DONE  # drafting on the anchor from here
        progress = decode.inbound[8]
        _prepared(decode, progress, 8)
        assert progress.prepare_full(decode._prepare) is False  # once
        anchor_only = [x.clone() for x in (*k_dst, *v_dst)]
        progress.upgrade_kv()
        assert progress.full_decoded and progress.prepared is None
        prepared = [x.clone() for x in (*k_dst, *v_dst)]
        progress.decode_into_pool(with_residual=True)  # the in-place decode: the same bytes
        outside = torch.ones(k_dst[0].shape[0], dtype=torch.bool)
        outside[dst] = False
        for before, after, now in zip(anchor_only, prepared, (*k_dst, *v_dst), strict=True):
            assert torch.equal(after.view(torch.int16), now.view(torch.int16))
            assert torch.equal(before[outside].view(torch.int16), after[outside].view(torch.int16))
        for a, b in zip((*k_src, *v_src), (*k_dst, *v_dst), strict=True):
            assert torch.equal(b[dst].view(torch.int16), a[src].view(torch.int16))
        assert poll_until_final(decode, 8, need_residual=True)[0] is Verdict.DONE
        wait_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_prepared_upgrade_that_failed_is_decoded_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_lynx.integration.transport.exact_prefetch import ExactPrefetch

    def broken(self: Any) -> Any:
        raise RuntimeError("injected: the worker's decode failed")

    monkeypatch.setattr(ExactPrefetch, "finish", broken)
    prefill, decode, (k_src, v_src), (k_dst, v_dst) = _pair(LynxConfig(mode="lynx-exact"), 1, 120)
    try:
        src, dst = _send(prefill, decode, 9, 1, 120)
        assert poll_until_final(decode, 9, need_residual=False)[0] is Verdict.DONE
        progress = decode.inbound[9]
        _prepared(decode, progress, 9)
        progress.upgrade_kv()  # logs the failure, decodes in place
        assert progress.full_decoded
        for a, b in zip((*k_src, *v_src), (*k_dst, *v_dst), strict=True):
            assert torch.equal(b[dst].view(torch.int16), a[src].view(torch.int16))
        assert poll_until_final(decode, 9, need_residual=True)[0] is Verdict.DONE
        wait_idle(prefill, decode)
    finally:
        prefill.close()
        decode.close()

