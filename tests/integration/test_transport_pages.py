"""SGLang page indices -> the request's token slots (``transport.pages``), and a whole request of every
mode moved between two paged pools through the transport's encode/decode (no servers; the real PD
path at page sizes 16 and 64 is ``test_lynx_paged.py``)."""

from __future__ import annotations

import pytest
import torch

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.config import MODES, LynxConfig
from sglang_lynx.integration.transport.codec import decode_request_streams, encode_request_streams
from sglang_lynx.integration.transport.pages import PageLayoutError, pages_for, token_slots

pytestmark = pytest.mark.timeout(300)


def test_token_slots_of_pages() -> None:
    assert token_slots([4, 9, 2], 1).tolist() == [4, 9, 2]  # page size 1: pages are token slots
    assert token_slots([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert token_slots([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]  # partial last page
    assert token_slots([3, 1], 4, 5).tolist() == [12, 13, 14, 15, 4]
    assert token_slots([], 64, 0).tolist() == []
    assert pages_for(0, 64) == 0 and pages_for(1, 64) == 1 and pages_for(64, 64) == 1 and pages_for(65, 64) == 2


@pytest.mark.parametrize(("pages", "page_size", "tokens"), [([3, 1], 4, 4), ([3, 1], 4, 9), ([3], 0, 1), ([3], 1, 2)])
def test_token_counts_that_do_not_fit_the_pages_are_refused(pages: list[int], page_size: int, tokens: int) -> None:
    with pytest.raises(PageLayoutError):
        token_slots(pages, page_size, tokens)


def _pool(pages: int, page_size: int, fill: float | None, seed: int) -> list[torch.Tensor]:
    size = (pages + 1) * page_size  # SGLang's pools hold one page more (page 0: padding)
    if fill is not None:
        return [torch.full((size, 3, 64), fill, dtype=torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 64, generator=g) * (1 + 8 * (torch.rand(64, generator=g) > 0.95))).bfloat16()
            for _ in range(2)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("page_size", "tokens"), [(16, 300), (64, 300), (64, 256)])
def test_a_paged_request_lands_in_its_token_slots_only(mode: str, page_size: int, tokens: int) -> None:
    """Prefill pages -> the request's ``tokens`` slots -> encode -> decode into the decode's pages: every
    prompt slot holds the codec reconstruction of the prefill KV (as with page size 1), and the unused
    tail of the last page and every other page are left as they were."""
    config = LynxConfig(mode=mode)
    codec = get_codec(config.codec_name, **config.codec_params())
    n_pages = pages_for(tokens, page_size)
    total = n_pages + 6
    k_src, v_src = _pool(total, page_size, None, seed=tokens), _pool(total, page_size, None, seed=tokens + 1)
    src_pages = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:n_pages] + 1
    src = token_slots(src_pages, page_size, tokens)
    k_layers, v_layers = [x[src] for x in k_src], [x[src] for x in v_src]
    anchor, residual = encode_request_streams(k_layers, v_layers, codec, config)

    sentinel = 7.0
    k_dst, v_dst = _pool(total, page_size, sentinel, 0), _pool(total, page_size, sentinel, 0)
    dst_pages = torch.randperm(total, generator=torch.Generator().manual_seed(2))[:n_pages] + 1
    dst = token_slots(dst_pages, page_size, tokens)
    decode_request_streams(anchor, residual if codec.two_streams else None, k_dst, v_dst, dst, codec, config)
    for kind, layers, pool in (("k", k_layers, k_dst), ("v", v_layers, v_dst)):
        for layer, (x, y) in enumerate(zip(layers, pool, strict=True)):
            want = codec.decode(codec.encode(x, kind, layer=layer), with_residual=True, dtype=y.dtype)
            assert torch.equal(y[dst].view(torch.uint8), want.view(torch.uint8)), (kind, layer)
            untouched = torch.ones(y.shape[0], dtype=torch.bool)
            untouched[dst] = False
            assert int(untouched.sum()) == y.shape[0] - tokens
            assert bool((y[untouched] == sentinel).all()), "a slot outside the request's tokens was written"


@pytest.mark.timeout(120)
def test_the_decode_side_expects_token_slots_and_tells_the_prefill_the_token_count() -> None:
    from sglang_lynx.integration.transport.decode_side import LynxDecodeSide
    from sglang_lynx.integration.transport.wire import parse_field

    side = LynxDecodeSide(LynxConfig(mode="lynx"), "127.0.0.1")
    try:
        side.attach_pool([torch.zeros(1024, 2, 64)], [torch.zeros(1024, 2, 64)], pool_tokens=1024,
                         max_request_tokens=1024, page_size=16)
        assert side.expect(5, [7, 2, 9], page_size=16, tokens=40) is True
        assert side.inbound[5].slots.tolist() == [*range(112, 128), *range(32, 48), *range(144, 152)]
        frame = parse_field([side.metadata_field(5)])
        assert frame is not None and frame["tokens"] == 40 and isinstance(frame["target"], dict)
        with pytest.raises(PageLayoutError, match="token count"):  # pages without a count: refused, not guessed
            side.expect(6, [3], page_size=16)
        with pytest.raises(PageLayoutError):
            side.expect(7, [3, 4], page_size=16, tokens=40)
        assert 6 not in side.inbound and 7 not in side.inbound
        side.abort(5)
    finally:
        side.close()


@pytest.mark.timeout(120)
def test_the_prefill_side_gathers_paged_chunks_and_cuts_the_last_pages_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's chunks name pages (all but the last end on a page boundary); the request handed to the
    encoder is exactly its ``tokens`` tokens, in order, read from the pages' slots."""
    from types import SimpleNamespace

    from sglang_lynx.integration.transport import prefill_side as tp
    from sglang_lynx.transfer.streams import RemoteTarget, StreamKind, StreamRegion

    page, tokens = 16, 40
    side = tp.LynxPrefillSide(LynxConfig(mode="lynx", stream_prefill=False), "127.0.0.1")  # buffered
    pool = [torch.randn(1024, 2, 64)]
    side.attach_pool(pool, [pool[0] * 2], pool_tokens=1024, max_request_tokens=1024, page_size=page)
    submitted: list[tp.Pending] = []
    monkeypatch.setattr(side, "_submit", lambda manager, room, pending: submitted.append(pending) or 0)
    target = RemoteTarget("127.0.0.1:1", 1 << 32, 1 << 20, {StreamKind.ANCHOR: StreamRegion(1 << 32, 1 << 19),
                                                              StreamKind.RESIDUAL: StreamRegion((1 << 32) + (1 << 19),
                                                                                                1 << 19)})
    info = SimpleNamespace(is_dummy=False, dst_kv_indices=[30, 31, 32], decode_prefix_len=0, mooncake_session_id="s",
                           lynx={"target": target.to_dict(), "tokens": tokens})
    manager = SimpleNamespace(transfer_infos={9: {"s": info}}, record_failure=lambda room, why: None,
                              decode_kv_args_table={"s": SimpleNamespace(lynx={"fingerprint": side.fingerprint,
                                                                             "control": "tcp://127.0.0.1:1"})})
    try:
        assert side.send_kvcache(manager, "s", [5, 1], [30, 31]) == 0 and not submitted  # 2 of 3 pages
        assert side.send_kvcache(manager, "s", [8], [32]) == 0 and len(submitted) == 1
        got = submitted[0]
        k = torch.cat([part[0] for part in got.k_parts])[: got.total_tokens]
        slots = torch.tensor([*range(80, 96), *range(16, 32), *range(128, 136)])
        assert got.total_tokens == tokens and torch.equal(k, pool[0][slots])
        info.lynx["tokens"] = 49  # 4 pages' worth for 3 pages: refused, naming the mismatch
        assert side.send_kvcache(manager, "s", [5, 1, 8], [30, 31, 32]) == -1
    finally:
        side.close()
