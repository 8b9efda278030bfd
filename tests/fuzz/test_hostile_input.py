"""Hostile input (hypothesis): malformed configs, peer frames, control messages and codec buffers get
a clear error of the documented type — never a crash, a hang, or a write outside the given buffers."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_lynx.codec.registry import codec_names, get_codec
from sglang_lynx.config import LynxConfig, LynxConfigError
from sglang_lynx.integration.transport.wire import MAGIC, LynxWireError, parse_field, validate_registration
from sglang_lynx.transfer.control import ControlMessageError, decode_message
from sglang_lynx.transfer.streams import RemoteTarget, StreamDescriptor, TransferMetadataError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
config_fields = st.sampled_from(["mode", "page_tokens", "chunk_tokens", "alpha", "group_size", "sink_tokens",
                                 "residual_chunk_bytes", "residual_window", "transfer_timeout_s",
                                 "max_draft_tokens", "residual_timeout_s", "fallback", "bogus"])


@FAST
@given(st.dictionaries(config_fields, json_values, max_size=5))
def test_lynx_config_parser_only_raises_config_errors(data: dict) -> None:
    try:
        config = LynxConfig.parse(json.dumps(data))
    except LynxConfigError:
        return
    assert LynxConfig.parse(config.to_json()) == config  # whatever it accepts is valid and round-trips


@FAST
@given(st.text(max_size=200))
def test_lynx_config_parser_on_arbitrary_text(text: str) -> None:
    with contextlib.suppress(LynxConfigError):
        LynxConfig.parse(text)


@FAST
@given(st.binary(max_size=300), st.booleans())
def test_peer_frames(raw: bytes, with_magic: bool) -> None:
    frame = MAGIC + raw if with_magic else raw
    try:
        data = parse_field([b"x", frame])
        if data is not None:
            validate_registration(data)
    except LynxWireError:
        pass


@FAST
@given(st.dictionaries(st.sampled_from(["session", "arena_addr", "arena_bytes", "control", "fingerprint"]),
                       json_values, max_size=5))
def test_registration_dicts(data: dict) -> None:
    try:
        checked = validate_registration(data)
    except LynxWireError:
        return
    assert checked["arena_addr"] > 0 and checked["arena_bytes"] > 0


@FAST
@given(st.binary(max_size=400) | st.builds(lambda v: json.dumps(v).encode(), json_values))
def test_control_messages(raw: bytes) -> None:
    try:
        msg = decode_message(raw)
    except ControlMessageError:
        return
    assert msg["type"] in ("landed", "failed", "quiet", "progress")


@FAST
@given(json_values)
def test_stream_metadata(data: object) -> None:
    for parse in (StreamDescriptor.from_dict, RemoteTarget.from_dict):
        with contextlib.suppress(TransferMetadataError):
            parse(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(codec_names()), st.integers(1, 70), st.sampled_from(["k", "v"]),
       st.binary(max_size=4096), st.binary(max_size=4096) | st.none(), st.integers(0, 2))
def test_codec_decoder_on_malformed_buffers(name: str, tokens: int, kind: str, anchor: bytes,
                                            residual: bytes | None, tweak: int) -> None:
    codec = get_codec(name)
    want_anchor, want_residual = codec.stream_bytes(tokens, 1, 64, kind)
    if tweak == 1:  # right lengths, garbage content
        anchor = (anchor * (want_anchor // max(len(anchor), 1) + 1))[:want_anchor] if anchor else bytes(want_anchor)
        if residual is not None:
            residual = (residual * (want_residual // max(len(residual), 1) + 1))[:want_residual]
    canary = torch.full((tokens + 8, 1, 64), 7.0, dtype=torch.bfloat16)
    out = canary[4: 4 + tokens]
    with contextlib.suppress(ValueError, TypeError):
        codec.decode_from_bytes(anchor, residual, tokens, 1, 64, kind, out=out)
    # never a write outside the given buffer
    assert torch.all(canary[:4] == 7.0) and torch.all(canary[4 + tokens:] == 7.0)


@pytest.mark.timeout(120)
def test_a_fuzz_test_can_fail() -> None:
    """The codec decoder rejects a short buffer with ValueError (so the fuzz tests above are not vacuous)."""
    codec = get_codec("lynx")
    with pytest.raises(ValueError, match="anchor bytes"):
        codec.decode_from_bytes(b"\x00" * 3, None, 5, 1, 64, "k")
