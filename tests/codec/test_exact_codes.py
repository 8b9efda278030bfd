"""The documented codes, checked on hand-computed examples."""

from __future__ import annotations

import torch

from sglang_lynx.codec.layout import LayoutParams
from sglang_lynx.codec.lynx_format import decode_pages, encode_pages
from sglang_lynx.codec.quant_math import fp16_ceil, fp16_floor, pack_codes, unpack_codes

PARAMS = LayoutParams(page_tokens=16, chunk_tokens=16, key_chunk_tokens=16,
                      group_size=64, sink_tokens=0, value_group_size=4)


def one_channel(values: list[float]) -> torch.Tensor:
    """A page of len(values) tokens, 1 head, 4 dims; the values sit in dim 0, the rest is 0."""
    x = torch.zeros(1, len(values), 1, 4)
    x[0, :, 0, 0] = torch.tensor(values)
    return x


def test_lynx_key_codes_follow_the_docstring() -> None:
    # mn = 0, rng = 15: u = x / 15. x = 3 -> a = 3, r = 7; x = 0.5 (tie) -> a = 0 (half down), f = 7,
    # r = 14; x = 14.5 -> a = 14 (tie, down), f = ceil(217.5 - .5) = 217 -> r = 217 - 210 + 7 = 14.
    values = [0.0, 3.0, 0.5, 14.5] + [15.0] * 12
    anchor, residual = encode_pages(one_channel(values), "k", 0, PARAMS, 0.0, "test")
    groups = 4  # one chunk x 4 channels
    mn = anchor[0, : 2 * groups].view(torch.float16)
    rng = anchor[0, 2 * groups : 4 * groups].view(torch.float16)
    assert mn[0] == 0 and rng[0] == 15
    a = unpack_codes(anchor[:, 4 * groups :], 4).view(16, 4)[:, 0]
    r = unpack_codes(residual, 4).view(16, 4)[:, 0]
    assert a[:4].tolist() == [0, 3, 0, 14] and a[4] == 15
    assert r[:4].tolist() == [7, 7, 14, 14] and r[4] == 7
    full = decode_pages(anchor, residual, 16, 1, 4, "k", PARAMS, 0.0)[0, :, 0, 0]
    assert torch.allclose(full[:4], torch.tensor([0.0, 3.0, 7 * 15 / 225, 217 * 15 / 225]))
    draft = decode_pages(anchor, None, 16, 1, 4, "k", PARAMS, 0.0)[0, :, 0, 0]
    assert draft[:4].tolist() == [0.0, 3.0, 0.0, 14.0]


def test_lynx_value_groups_run_along_the_token() -> None:
    x = torch.tensor([[-1.0, 0.0, 1.0, 2.0]]).view(1, 1, 1, 4)
    anchor, _ = encode_pages(x, "v", 1, PARAMS, 0.0, "test")
    assert anchor[0, :2].view(torch.float16).item() == -1.0
    assert anchor[0, 2:4].view(torch.float16).item() == 3.0
    assert unpack_codes(anchor[:, 4:], 4).tolist() == [[0, 5, 10, 15]]


def test_directed_fp16_rounding() -> None:
    x = torch.tensor([0.1, -0.1, 0.0, 1.0, 1e-9, -1e-9])
    lo, hi = fp16_floor(x), fp16_ceil(x)
    assert (lo.float() <= x).all() and (hi.float() >= x).all()
    assert lo[3] == 1.0 and hi[3] == 1.0 and lo[2] == 0.0
    assert (hi.float() - lo.float())[:2].gt(0).all()


def test_packing_round_trips_and_is_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43]]
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6]]
    rand = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(rand, 4), 4), rand)
    assert torch.equal(unpack_codes(pack_codes(rand & 3, 2), 2), rand & 3)


def test_lynx_paper_codes_follow_the_docstring() -> None:
    from sglang_lynx.codec.registry import get_codec

    codec = get_codec("lynx-paper", page_tokens=16, chunk_tokens=16, key_chunk_tokens=16, alpha=0.0)
    values = [0.0, 1.0] * 7 + [0.49, 0.51]  # page min 0, scale 1; chunk mean 0.5, spread 0.5
    x = torch.zeros(16, 1, 4)
    x[:, 0, 0] = torch.tensor(values)
    enc = codec.encode(x, "k")
    meta = 2 * 4 + 2 * 4 + 2 * 4 + 2 * 4  # pmin, pscale, mu, sigma: 4 channels each, fp16
    fields = enc.anchor[:meta].view(torch.float16).view(4, 4)[:, 0].tolist()
    assert fields == [0.0, 1.0, 0.5, 0.5]
    anchor = unpack_codes(enc.anchor[meta:].view(1, -1), 4).view(16, 4)[:, 0].tolist()
    residual = unpack_codes(enc.residual.view(1, -1), 4).view(16, 4)[:, 0].tolist()
    # t = -1 -> sign 1, seg 7, r 15 ; t = +1 -> seg 7, r 15 ; t = -0.02 -> "-0": sign 1, seg 0, r 2
    assert anchor[:2] == [15, 7] and residual[:2] == [15, 15]
    assert anchor[14:] == [8, 0] and residual[14:] == [2, 2]
    draft = codec.decode(enc, with_residual=False, dtype=torch.float32)[:, 0, 0]
    full = codec.decode(enc, with_residual=True, dtype=torch.float32)[:, 0, 0]
    assert torch.allclose(draft[:2], torch.tensor([0.5 - 0.5 * 7.5 / 8, 0.5 + 0.5 * 7.5 / 8]))
    assert torch.allclose(full[:2], torch.tensor([0.5 - 0.5 * (7 + 15.5 / 16) / 8, 0.5 + 0.5 * (7 + 15.5 / 16) / 8]))
    assert torch.allclose(full[14:], torch.tensor([0.5 - 0.5 * 2.5 / 128, 0.5 + 0.5 * 2.5 / 128]))
