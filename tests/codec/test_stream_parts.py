"""Streams encoded in page-range parts (``codec.stream_parts``) equal the whole-request encode byte for byte."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import encode_request
from sglang_lynx.codec.stream_parts import PartEncoder
from sglang_lynx.codec.wire_residual import residual_to_wire

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 64
CODECS = ["lynx", "lynx-int8", "lynx-int4", "lynx-exact", "int8", "int4", "bf16", "kivi-int4", "lynx-paper"]


def layers(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks = [outlier_kv(tokens, HEADS, DIM, seed + i).to(torch.bfloat16) for i in range(LAYERS)]
    vs = [outlier_kv(tokens, HEADS, DIM, seed + 50 + i).to(torch.bfloat16) for i in range(LAYERS)]
    return ks, vs


def codec_for(name: str):  # noqa: ANN201
    extra = {"kivi_recent_tokens": 40} if name.startswith("kivi") else {}
    return get_codec(name, page_tokens=PAGE, key_chunk_tokens=32, chunk_tokens=32, **extra)


def _part_buffers(codec, ks, vs, encoder=None):  # noqa: ANN001, ANN202
    """A request's part encoder, its filled-with-a-pattern streams, and NaN inputs: rows the prefill has not
    computed yet are garbage, a part must never read them."""
    parts = PartEncoder(encoder or codec, len(ks), int(ks[0].shape[0]), HEADS, DIM)
    anchor = torch.full((parts.anchor_bytes,), 0xA5, dtype=torch.uint8)
    body = torch.full((parts.body_bytes,), 0x5A, dtype=torch.uint8) if parts.body_bytes else None
    k_in = [torch.full_like(x, float("nan")) for x in ks]
    v_in = [torch.full_like(x, float("nan")) for x in vs]
    return parts, anchor, parts.new_scratch(), body, k_in, v_in


def encode_in_parts(codec, ks, vs, chunk_ends: list[int], encoder=None):  # noqa: ANN001, ANN201
    """Feed the request as prefill chunks ending at ``chunk_ends`` (tokens): the streams and every span sent."""
    tokens = int(ks[0].shape[0])
    parts, anchor, computed, body, k_in, v_in = _part_buffers(codec, ks, vs, encoder)
    sent_a, sent_b, received = [], [], 0
    for end in chunk_ends:
        for src, dst in zip(ks + vs, k_in + v_in, strict=True):
            dst[received:end] = src[received:end]
        received = end
        last = received >= tokens
        pages = parts.encodable_pages(received)
        if pages > parts.next_page or last:
            a, b = parts.encode_part(k_in, v_in, pages, last, anchor, computed, body)
            sent_a += a
            sent_b += b
    assert parts.done
    return anchor, body, sent_a, sent_b


def covered_once(spans: list[tuple[int, int]], size: int) -> bool:
    seen = torch.zeros(size, dtype=torch.int32)
    for at, n in spans:
        seen[at : at + n] += 1
    return bool((seen == 1).all())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize(("tokens", "chunk_ends"), [
    (300, [128, 256, 300]),  # page-aligned chunks, a partial last page
    (300, [100, 200, 300]),  # chunks that end inside pages: the rest of a page waits for the next chunk
    (256, [64, 256]),  # the last chunk ends on a page boundary
    (150, [130, 150]),  # a last chunk shorter than the recent window: its trailer reaches into part 0
    (300, [10, 20, 300]),  # chunks smaller than a page: no part until a page is complete
    (300, [300]),  # one chunk: one part, the whole request
])
def test_parts_equal_the_whole_request_encode(name: str, tokens: int, chunk_ends: list[int]) -> None:
    codec = codec_for(name)
    ks, vs = layers(tokens, seed=tokens + len(chunk_ends))
    want = encode_request(ks, vs, codec)
    anchor, body, sent_a, sent_b = encode_in_parts(codec, ks, vs, chunk_ends)
    assert torch.equal(anchor, want.anchor)
    assert covered_once(sent_a, anchor.numel())
    if codec.two_streams and codec._send_residual():
        want_body = residual_to_wire(want.residual, codec, LAYERS, tokens, HEADS, DIM)
        assert body is not None and torch.equal(body, want_body)
        assert covered_once(sent_b, body.numel())
    else:
        assert body is None and sent_b == []


def c_page_encoder():  # noqa: ANN201
    """The lynx codec and its C page encoder (the test skips where the C path is not built)."""
    from sglang_lynx.config import LynxConfig
    from sglang_lynx.integration.transport.codec import FastPageEncoder, _params

    pytest.importorskip("sglang_lynx.kernels.lynx_cpu_pages")
    config = LynxConfig(page_tokens=PAGE)
    codec = get_codec("lynx", **config.codec_params())
    try:
        return codec, FastPageEncoder(codec, _params(config))
    except Exception as exc:  # noqa: BLE001 - the C path is optional (no compiler at set-up)
        pytest.skip(f"C fast path not built: {exc}")


@pytest.mark.parametrize("groups", [None, [range(0, 1), range(1, 2)]], ids=["chunks", "layer-groups"])
def test_the_c_page_encoder_gives_the_same_parts(groups: list[range] | None) -> None:
    codec, encoder = c_page_encoder()
    ks, vs = layers(333, seed=7)
    want = encode_request(ks, vs, codec)
    if groups is None:
        anchor, body, _, _ = encode_in_parts(codec, ks, vs, [100, 257, 333], encoder)
    else:
        anchor, body, _, _ = encode_in_layer_groups(codec, ks, vs, [100, 257, 333], groups, encoder)
    assert torch.equal(anchor, want.anchor)
    assert torch.equal(body, residual_to_wire(want.residual, codec, LAYERS, 333, HEADS, DIM))


def test_parts_out_of_order_or_after_the_last_are_refused() -> None:
    codec = codec_for("lynx")
    ks, vs = layers(200, seed=3)
    parts = PartEncoder(codec, LAYERS, 200, HEADS, DIM)
    anchor = torch.empty(parts.anchor_bytes, dtype=torch.uint8)
    computed, body = parts.new_scratch(), torch.empty(parts.body_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pages"):
        parts.encode_part(ks, vs, 5, False, anchor, computed, body)  # past the request's 4 pages
    parts.encode_part(ks, vs, 2, False, anchor, computed, body)
    with pytest.raises(ValueError, match="pages"):
        parts.encode_part(ks, vs, 2, False, anchor, computed, body)  # nothing new
    with pytest.raises(ValueError, match="anchor buffer"):
        parts.encode_part(ks, vs, 3, False, anchor[:-1], computed, body)
    parts.encode_part(ks, vs, 0, True, anchor, computed, body)
    with pytest.raises(ValueError, match="last part"):
        parts.encode_part(ks, vs, 4, True, anchor, computed, body)


def test_nan_in_a_part_names_the_layer() -> None:
    codec = codec_for("lynx")
    ks, vs = layers(200, seed=4)
    vs[1][70, 0, 3] = float("nan")
    parts = PartEncoder(codec, LAYERS, 200, HEADS, DIM)
    anchor = torch.empty(parts.anchor_bytes, dtype=torch.uint8)
    computed, body = parts.new_scratch(), torch.empty(parts.body_bytes, dtype=torch.uint8)
    parts.encode_part(ks, vs, 1, False, anchor, computed, body)  # page 0 is clean
    with pytest.raises(ValueError, match="layer 1"):
        parts.encode_part(ks, vs, 2, False, anchor, computed, body)


def encode_in_layer_groups(codec, ks, vs, chunk_ends: list[int], groups: list[range], encoder=None,  # noqa: ANN001, ANN201
                           complete: int = 0):
    """As a prefill with layer groups streams: each chunk's rows of a group's layers arrive (and its full
    pages are encoded) before the next group's; after the last chunk one part of every layer completes
    the request (the partial last page, the trailers). ``complete``: in the last chunk the first
    ``complete`` groups take their layers to the end themselves (partial last page and trailers: a
    forward that computed the request's last token), and the last part completes only the others."""
    parts, anchor, computed, body, k_in, v_in = _part_buffers(codec, ks, vs, encoder)
    sent_a, sent_b, received = [], [], 0
    tokens = int(ks[0].shape[0])
    for end in chunk_ends:
        for g, group in enumerate(groups):
            # full pages only: the partial last page goes with the last part, unless the group completes
            full = parts.pages if end >= tokens and g < complete else end // parts.page
            for i in group:
                k_in[i][received:end], v_in[i][received:end] = ks[i][received:end], vs[i][received:end]
            if full > parts.next_pages[group.start]:
                a, b = parts.encode_part(k_in, v_in, full, False, anchor, computed, body, layers=group)
                sent_a += a
                sent_b += b
        received = end
    a, b = parts.encode_part(k_in, v_in, parts.pages, True, anchor, computed, body)
    return anchor, body, sent_a + a, sent_b + b


@pytest.mark.parametrize("name", ["lynx", "lynx-exact", "int8", "kivi-int4", "bf16"])
@pytest.mark.parametrize(("tokens", "chunk_ends"), [
    (300, [128, 256, 300]), (300, [100, 200, 300]), (256, [64, 256]), (256, [256]), (300, [300]), (40, [40]),
    (150, [130, 150]),
])
@pytest.mark.parametrize("complete", [0, 1, 2], ids=["last-part", "first-group-completes", "every-group-completes"])
def test_layer_group_parts_equal_the_whole_request_encode(name: str, tokens: int, chunk_ends: list[int],
                                                          complete: int) -> None:
    codec = codec_for(name)
    ks = [outlier_kv(tokens, HEADS, DIM, tokens + i).to(torch.bfloat16) for i in range(3)]
    vs = [outlier_kv(tokens, HEADS, DIM, tokens + 50 + i).to(torch.bfloat16) for i in range(3)]
    want = encode_request(ks, vs, codec)
    anchor, body, sent_a, sent_b = encode_in_layer_groups(codec, ks, vs, chunk_ends, [range(0, 1), range(1, 3)],
                                                          complete=complete)
    assert torch.equal(anchor, want.anchor)
    assert covered_once(sent_a, anchor.numel())
    if codec.two_streams and codec._send_residual():
        assert body is not None and torch.equal(body, residual_to_wire(want.residual, codec, 3, tokens, HEADS, DIM))
        assert covered_once(sent_b, body.numel())


def test_layer_group_parts_out_of_step_are_refused() -> None:
    codec = codec_for("lynx")
    ks, vs = layers(200, seed=5)
    parts = PartEncoder(codec, LAYERS, 200, HEADS, DIM)
    anchor = torch.empty(parts.anchor_bytes, dtype=torch.uint8)
    computed, body = parts.new_scratch(), torch.empty(parts.body_bytes, dtype=torch.uint8)
    parts.encode_part(ks, vs, 2, False, anchor, computed, body, layers=range(0, 1))
    assert parts.next_pages == [2, 0] and parts.next_page == 0
    with pytest.raises(ValueError, match="different pages"):
        parts.encode_part(ks, vs, 3, False, anchor, computed, body, layers=range(0, 2))
    with pytest.raises(ValueError, match="layers"):
        parts.encode_part(ks, vs, 3, False, anchor, computed, body, layers=range(1, 3))
    parts.encode_part(ks, vs, 2, False, anchor, computed, body, layers=range(1, 2))
    parts.encode_part(ks, vs, parts.pages, False, anchor, computed, body, layers=range(0, 1))
    assert parts.completed == [True, False] and parts.runs(0, True) == [(1, 2, parts.pages)]
    with pytest.raises(ValueError, match="already encoded through the last page"):
        parts.encode_part(ks, vs, parts.pages, False, anchor, computed, body, layers=range(0, 1))
    parts.encode_part(ks, vs, 0, True, anchor, computed, body)
    assert parts.done
