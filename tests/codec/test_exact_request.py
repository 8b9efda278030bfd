"""A whole request through ``lynx-exact``'s three streams into a bf16 KV pool: byte-equal to the prefill KV.

Pool slots as SGLang hands them out at page size 1 (scattered) and 64 (runs of 64 slots); partial
pages, the sink token, ±0 and subnormals in the KV; the 8-bit values a ``lynx`` decode wrote before
are overwritten. Unit tier: the codec functions the transport will call, no servers.
"""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec import lynx_exact
from sglang_lynx.codec.exact_request import (
    ExactRequestWriter,
    decode_exact_request_into,
    encode_exact_request,
    exact_request_capacity,
    parse_exact_request,
)
from sglang_lynx.codec.lynx_exact import ExactStreamError
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import decode_request_into, encode_request

LAYERS, HEADS, DIM, POOL_SLOTS = 3, 3, 64, 2048


def request_kv(tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks, vs = [], []
    for layer in range(LAYERS):
        k, v = outlier_kv(tokens, HEADS, DIM, seed=layer), outlier_kv(tokens, HEADS, DIM, seed=100 + layer) * 0.1
        k[tokens // 2, 0, :3] = torch.tensor([0.0, -0.0, 1e-40])
        v[tokens - 1, 2, :2] = torch.tensor([-1e-39, -0.0])
        ks.append(k.to(torch.bfloat16))
        vs.append(v.to(torch.bfloat16))
    return ks, vs


def assert_same_kv(k_got: list[torch.Tensor], v_got: list[torch.Tensor], ks: list[torch.Tensor],
                   vs: list[torch.Tensor]) -> None:
    """Every layer's K and V bit for bit (bf16 compared as int16: -0 and NaN payloads count)."""
    for got, want in zip((*k_got, *v_got), (*ks, *vs), strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def slots(tokens: int, page_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens + page_size)
    pages = torch.randperm(POOL_SLOTS // page_size, generator=gen)[: -(-tokens // page_size)]
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)[:tokens].to(torch.int64)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("tokens", [1, 100, 300])
def test_three_streams_restore_the_prefill_kv_byte_for_byte(page_size: int, tokens: int) -> None:
    codec = get_codec("lynx-exact", page_tokens=256)
    ks, vs = request_kv(tokens)
    payload = encode_request(ks, vs, codec)
    exact = encode_exact_request(ks, vs, payload, codec)
    k_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    where = slots(tokens, page_size)
    decode_request_into(payload, k_pool, v_pool, where, with_residual=False, codec=codec)  # the anchor stage
    decode_exact_request_into(payload.anchor, payload.residual, exact, k_pool, v_pool, where, codec=codec)
    for layer in range(LAYERS):
        assert torch.equal(k_pool[layer][where].view(torch.int16), ks[layer].view(torch.int16))
        assert torch.equal(v_pool[layer][where].view(torch.int16), vs[layer].view(torch.int16))
    untouched = torch.ones(POOL_SLOTS, dtype=torch.bool)
    untouched[where] = False
    assert all(int(pool[untouched].view(torch.int16).abs().sum()) == 0 for pool in (*k_pool, *v_pool))
    values = 2 * LAYERS * tokens * HEADS * DIM
    assert len(exact) * 8 / values < 16, "the exact stream costs more than BF16"


def test_bad_pools_and_streams_are_refused() -> None:
    codec = get_codec("lynx-exact")
    ks, vs = request_kv(40)
    payload = encode_request(ks, vs, codec)
    exact = encode_exact_request(ks, vs, payload, codec)
    where = torch.arange(40, dtype=torch.int64)
    fp32 = [torch.zeros(64, HEADS, DIM) for _ in range(LAYERS)]
    with pytest.raises(TypeError, match="bf16"):
        decode_exact_request_into(payload.anchor, payload.residual, exact, fp32, fp32, where, codec=codec)
    bf16 = [torch.zeros(64, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(ExactStreamError):
        decode_exact_request_into(payload.anchor, payload.residual, exact[:-1], bf16, bf16, where, codec=codec)
    with pytest.raises(ExactStreamError, match="2-layer"):
        parse_exact_request(exact, 2, 1)
    with pytest.raises(ValueError, match="no exact stream"):
        encode_exact_request(ks, vs, payload, get_codec("lynx"))
    with pytest.raises(ValueError, match="do not fit"):
        decode_exact_request_into(payload.anchor[:-1], payload.residual, exact, bf16, bf16, where, codec=codec)


def _writer(ks: list[torch.Tensor], codec: object, impl: object = lynx_exact) -> ExactRequestWriter:
    tokens = int(ks[0].shape[0])
    out = torch.zeros(exact_request_capacity(LAYERS, tokens, HEADS, DIM, 64), dtype=torch.uint8)
    return ExactRequestWriter(codec, LAYERS, tokens, HEADS, DIM, out, impl)  # type: ignore[arg-type]


def _restored(payload: object, exact: bytes, codec: object, tokens: int) -> tuple[list[torch.Tensor], ...]:
    k_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v_pool = [torch.zeros(POOL_SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    where = slots(tokens, 64)
    decode_exact_request_into(payload.anchor, payload.residual, exact, k_pool, v_pool, where,  # type: ignore[attr-defined]
                              codec=codec)  # type: ignore[arg-type]
    return [p[where] for p in k_pool], [p[where] for p in v_pool]


@pytest.mark.parametrize("tokens", [64, 200, 257])
@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_written_part_by_part_in_any_split_restore_the_kv(tokens: int, seed: int) -> None:
    """As a streamed prefill writes it: runs of pages per layer group, in page order per layer, layers
    interleaved; each piece coded before the later pages and the trailer exist."""
    codec = get_codec("lynx-exact", page_tokens=64)
    ks, vs = request_kv(tokens)
    payload = encode_request(ks, vs, codec)
    pages = -(-tokens // 64)
    gen = torch.Generator().manual_seed(seed)
    writer = _writer(ks, codec)
    done = [0] * LAYERS
    while min(done) < pages:
        layer = int(torch.randint(LAYERS, (1,), generator=gen))
        if done[layer] == pages:
            continue
        end = done[layer] + 1 + int(torch.randint(pages - done[layer], (1,), generator=gen))
        # what the prefill has written so far: these pages' blocks; later pages and every trailer unknown
        anchor, residual = torch.randint(0, 256, payload.anchor.shape, dtype=torch.uint8, generator=gen), \
            torch.randint(0, 256, payload.residual.shape, dtype=torch.uint8, generator=gen)  # fmt: skip
        view = writer.layout
        for kind in ("k", "v"):
            enc, _ = view.view(payload.anchor, payload.residual, layer, kind, done[layer], end)
            mine, _ = view.view(anchor, residual, layer, kind, done[layer], end)
            mine.anchor.copy_(enc.anchor)
            mine.residual.copy_(enc.residual)
        at, n = writer.write(ks, vs, anchor, residual, [(layer, done[layer], end)])
        assert at + n == writer.length and n > 0
        done[layer] = end
    writer.write(ks, vs, payload.anchor, payload.residual, [], last=True)
    exact = writer.out[: writer.length].numpy().tobytes()
    assert len(parse_exact_request(exact, LAYERS, pages)) >= 2 * LAYERS
    assert_same_kv(*_restored(payload, exact, codec, tokens), ks, vs)


def test_a_whole_layer_piece_is_the_layer_exact_stream_and_the_c_path_writes_the_same_bytes() -> None:
    from sglang_lynx.codec.base import EncodedKV
    from sglang_lynx.codec.request import request_spans

    codec = get_codec("lynx-exact", page_tokens=64)
    ks, vs = request_kv(200)
    payload = encode_request(ks, vs, codec)
    exact = encode_exact_request(ks, vs, payload, codec)
    pieces = {(p.layer, p.kind): p for p in parse_exact_request(exact, LAYERS, 4)}
    assert len(pieces) == 2 * LAYERS
    for span in request_spans(codec, LAYERS, 200, HEADS, DIM):
        piece = pieces[(span.layer, span.kind)]
        assert (piece.first_page, piece.end_page) == (0, 4)
        enc = EncodedKV(payload.anchor[span.anchor_offset : span.anchor_offset + span.anchor_bytes],
                        payload.residual[span.residual_offset : span.residual_offset + span.residual_bytes],
                        200, HEADS, DIM, span.kind, codec.name)  # fmt: skip
        x = (ks if span.kind == "k" else vs)[span.layer]
        assert piece.data == lynx_exact.encode_exact(x, enc, codec.params)
    try:
        from sglang_lynx.kernels import lynx_exact_cpu

        lynx_exact_cpu.library()
    except Exception as exc:  # noqa: BLE001 - the C path is optional; its own tests build it
        pytest.skip(f"lynx-exact C fast path not built: {exc}")
    writer = _writer(ks, codec, lynx_exact_cpu)
    writer.write(ks, vs, payload.anchor, payload.residual, [(0, 0, 1), (1, 0, 3), (0, 1, 4), (2, 0, 4), (1, 3, 4)])
    reference = _writer(ks, codec)
    reference.write(ks, vs, payload.anchor, payload.residual, [(0, 0, 1), (1, 0, 3), (0, 1, 4), (2, 0, 4), (1, 3, 4)])
    assert torch.equal(writer.out[: writer.length], reference.out[: reference.length])


def test_malformed_piece_sequences_are_refused() -> None:
    import struct

    from sglang_lynx.codec.exact_request import END, PIECE, ExactStreamTooLarge

    codec = get_codec("lynx-exact", page_tokens=64)
    ks, vs = request_kv(200)
    payload = encode_request(ks, vs, codec)
    writer = _writer(ks, codec)
    with pytest.raises(ValueError, match="do not follow"):
        writer.write(ks, vs, payload.anchor, payload.residual, [(0, 1, 2)])  # page 0 not written yet
    writer.write(ks, vs, payload.anchor, payload.residual, [(layer, 0, 2) for layer in range(LAYERS)])
    with pytest.raises(ValueError, match="pages missing"):
        writer.write(ks, vs, payload.anchor, payload.residual, [], last=True)
    writer.write(ks, vs, payload.anchor, payload.residual, [(layer, 2, 4) for layer in range(LAYERS)], last=True)
    exact = writer.out[: writer.length].numpy().tobytes()
    with pytest.raises(ValueError, match="closed"):
        writer.write(ks, vs, payload.anchor, payload.residual, [])
    assert len(parse_exact_request(exact, LAYERS, 4)) == 4 * LAYERS
    second_at = 4 + PIECE.size + PIECE.unpack_from(exact, 4)[5]
    bad = {
        "no end": exact[: -END.size],
        "the first piece left out: a later one out of page order": exact[:4] + exact[second_at:],
        "only the first piece": exact[:second_at] + exact[-END.size :],
        "a wrong count": exact[:-4] + struct.pack("<I", 5),
        "a foreign magic": b"LXR1" + exact[4:],
        "a piece cut short": exact[: second_at - 1] + exact[-END.size :],
    }
    for why, data in bad.items():
        with pytest.raises(ExactStreamError):
            parse_exact_request(data, LAYERS, 4)
        with pytest.raises(ExactStreamError):
            _restored(payload, data, codec, 200)
        assert why
    small = ExactRequestWriter(codec, LAYERS, 200, HEADS, DIM, torch.zeros(1000, dtype=torch.uint8))
    with pytest.raises(ExactStreamTooLarge, match="exceeds the decode's region of 1000 bytes"):
        small.write(ks, vs, payload.anchor, payload.residual, [(0, 0, 4)])
