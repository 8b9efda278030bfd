"""Bad input fails clearly and loses nothing: NaN/Inf, shapes, dtypes, lengths, unknown names."""

from __future__ import annotations

import pytest
import torch
from codec_inputs import outlier_kv

from sglang_lynx.codec.registry import codec_names, get_codec


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_layer_and_page(name: str, bad: float) -> None:
    codec = get_codec(name, page_tokens=64, chunk_tokens=16, key_chunk_tokens=16)
    x = outlier_kv(200)
    x[130, 1, 2] = bad
    with pytest.raises(ValueError, match=r"layer 7 v: NaN or Inf in page 2 \(token 130\)"):
        codec.encode(x, "v", layer=7)


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.zeros(10, 64), "expected \\[num_tokens, num_heads, head_dim\\]"),
        (torch.zeros(10, 3, 64, dtype=torch.int32), "dtype torch.int32 not supported"),
        (torch.zeros(10, 1, 3), "multiple of 4"),
    ],
)
def test_wrong_shapes_and_dtypes(x: torch.Tensor, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        get_codec("lynx").encode(x, "k")


def test_wrong_kind_and_unknown_codec() -> None:
    with pytest.raises(ValueError, match="kind must be 'k' or 'v'"):
        get_codec("int8").encode(torch.zeros(4, 3, 64), "q")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown codec 'int3'; valid codecs: bf16, int8, int4, kivi-int4"):
        get_codec("int3")


def test_values_beyond_fp16_metadata_are_rejected() -> None:
    x = outlier_kv(40)
    x[3, 0, 0] = 1e6
    with pytest.raises(ValueError, match="exceeds 32000"):
        get_codec("lynx").encode(x, "k", layer=2)
    assert torch.equal(
        get_codec("bf16").decode(get_codec("bf16").encode(x, "k"), with_residual=False), x.to(torch.bfloat16)
    )


def test_decode_from_bytes_validates_lengths() -> None:
    codec = get_codec("lynx")
    x = outlier_kv(300)
    enc = codec.encode(x, "k")
    anchor, residual = bytes(enc.anchor.numpy()), bytes(enc.residual.numpy())
    full = codec.decode_from_bytes(anchor, residual, 300, 3, 64, "k")
    assert torch.equal(full, codec.decode(enc, with_residual=True))
    draft = codec.decode_from_bytes(anchor, None, 300, 3, 64, "k")
    assert torch.equal(draft, codec.decode(enc, with_residual=False))
    with pytest.raises(ValueError, match=f"got {len(anchor) - 1} anchor bytes, expected {len(anchor)}"):
        codec.decode_from_bytes(anchor[:-1], residual, 300, 3, 64, "k")
    with pytest.raises(ValueError, match="residual bytes, expected"):
        codec.decode_from_bytes(anchor, residual + b"\0", 300, 3, 64, "k")
    with pytest.raises(ValueError, match="anchor bytes, expected"):
        codec.decode_from_bytes(anchor, residual, 299, 3, 64, "k")


def test_decode_rejects_wrong_out_shape() -> None:
    codec = get_codec("int4")
    enc = codec.encode(outlier_kv(20), "v")
    with pytest.raises(ValueError, match="out has shape"):
        codec.decode(enc, with_residual=False, out=torch.empty(21, 3, 64))
