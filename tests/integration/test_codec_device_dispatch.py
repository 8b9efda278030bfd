"""Which codec path the transport takes on which device, and the CUDA staging, on the CPU (issue 17).

The Triton kernels' bytes are checked under the interpreter (``tests/kernels/test_lynx_triton.py``);
here: the dispatch table, a CUDA server on a host without a GPU falling back to the reference with a
log line (never a crash), and the decode/encode flow of a CUDA server run under ``DeviceGuard``
(the KV pool posing as CUDA tensors): the staged streams and slot ids are copied to the pool's
device once, and every tensor the kernel module gets is on that device.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from sglang_lynx.kernels import lynx_cpu_fast

from device_guard import DeviceGuard
from sglang_lynx.codec.registry import get_codec
from sglang_lynx.codec.request import decode_request_into, encode_request
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport import codec as transport_codec

LAYERS, TOKENS, HEADS, DIM = 2, 300, 2, 64


@pytest.mark.parametrize(("codec", "alpha", "device", "module"), [
    ("lynx", 0.0, "cpu", "lynx_cpu_fast"),
    ("lynx-int8", 0.0, "cuda", "lynx_triton"),
    ("lynx-int4", 0.0, "cuda:3", "lynx_triton"),
    ("lynx", 0.5, "cuda", None),  # companding: the kernels may differ by one code step; reference
    ("int8", 0.0, "cuda", None),  # a codec without kernels
    ("lynx", 0.0, "meta", None),
])
def test_the_kernel_module_follows_the_pool_device(codec: str, alpha: float, device: str, module: str | None) -> None:
    assert transport_codec.kernel_module_name(codec, alpha, device) == module


def test_a_cuda_server_without_a_usable_gpu_runs_the_reference_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the Triton path is checked by scripts/gpu_check.sh")
    monkeypatch.setattr(transport_codec, "_SELF_CHECKED", {})
    config = LynxConfig(mode="lynx")
    codec = get_codec(config.codec_name, **config.codec_params())
    with caplog.at_level(logging.INFO, logger="sglang_lynx.transport"):
        path = transport_codec.prepare_fast_path(codec, config, torch.device("cuda"))
    assert path == "torch reference"
    assert "codec on cuda: torch reference" in caplog.text


class KernelsOnDevice:
    """The C fast path standing in for the Triton module, asserting every tensor it gets is on the device."""

    CODEC_NAMES = lynx_cpu_fast.CODEC_NAMES
    __name__ = "fake-triton"

    def __init__(self, guard: DeviceGuard) -> None:
        self.guard, self.calls = guard, 0

    def _real(self, fn: Any, tensors: list[Any], *args: Any, **kwargs: Any) -> Any:
        for t in tensors:
            assert t is None or self.guard.on_device(t), "a host tensor reached the device kernels"
        self.calls += 1
        with torch._C.DisableTorchFunction():
            out = fn(*args, **kwargs)
        return out

    def encode(self, x: torch.Tensor, kind: str, **kw: Any) -> Any:
        enc = self._real(lynx_cpu_fast.encode, [x], x, kind, **kw)
        self.guard.put(enc.anchor)
        self.guard.put(enc.residual)
        return enc

    def decode_into(self, a: torch.Tensor, r: torch.Tensor | None, pool: torch.Tensor, slots: torch.Tensor,
                    **kw: Any) -> Any:
        return self._real(lynx_cpu_fast.decode_into, [a, r, pool, slots], a, r, pool, slots, **kw)


def _kv(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(TOKENS, HEADS, DIM, generator=gen).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(TOKENS, HEADS, DIM, generator=gen).bfloat16() for _ in range(LAYERS)]
    return k, v


def test_a_cuda_server_encodes_and_decodes_on_the_pool_device(monkeypatch: pytest.MonkeyPatch) -> None:
    config = LynxConfig(mode="lynx")
    codec = get_codec(config.codec_name, **config.codec_params())
    k, v = _kv(0)
    want = encode_request(k, v, codec)
    slots = torch.randperm(TOKENS + 10, generator=torch.Generator().manual_seed(1))[:TOKENS]
    with DeviceGuard() as guard:
        kernels = KernelsOnDevice(guard)
        monkeypatch.setattr(transport_codec, "_fast_module", lambda codec, config, device: (
            kernels if device.type == "cuda" else None))
        k_dev, v_dev = [guard.put(x.clone()) for x in k], [guard.put(x.clone()) for x in v]
        anchor, residual = transport_codec.encode_request_streams(k_dev, v_dev, codec, config)
        assert guard.on_device(anchor) and guard.on_device(residual)
        staged_a, staged_r = anchor.cpu(), residual.cpu()  # into the (pinned) send arena
        pools = {name: [guard.put(torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16)) for _ in range(LAYERS)]
                 for name in ("k", "v")}
        for residual_stream in (None, staged_r):  # the anchor-only admission, then the upgrade
            transport_codec.decode_request_streams(staged_a, residual_stream, pools["k"], pools["v"], slots, codec,
                                                   config)
        assert guard.violations == [], guard.violations
    assert kernels.calls == 2 * LAYERS + 4 * LAYERS  # encode k and v of each layer; decode them twice
    assert torch.equal(staged_a, want.anchor) and torch.equal(staged_r, want.residual)
    ref_k = [torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ref_v = [torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    decode_request_into((want.anchor, want.residual), ref_k, ref_v, slots, with_residual=True, codec=codec)
    for got, ref in zip(pools["k"] + pools["v"], ref_k + ref_v, strict=True):
        assert torch.equal(got, ref)


def test_the_arena_is_pinned_only_on_a_cuda_server() -> None:
    from sglang_lynx.integration.transport.arena import pinned_staging

    assert not pinned_staging(torch.device("cpu"))
    assert pinned_staging(torch.device("cuda")) == torch.cuda.is_available()


def test_without_kernels_a_cuda_server_runs_the_reference_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel module for the pool's device: the reference encodes the KV copied to the host and decodes
    on the host, copying the values into the device pool (on an H200 the reference on CUDA tensors gave
    other values than on the CPU); the pool holds the CPU reference's values."""
    config = LynxConfig(mode="lynx")
    codec = get_codec(config.codec_name, **config.codec_params())
    k, v = _kv(2)
    want = encode_request(k, v, codec)
    slots = torch.randperm(TOKENS + 10, generator=torch.Generator().manual_seed(3))[:TOKENS]
    seen: list[str] = []
    real_encode, real_decode = codec.encode, codec.decode
    with DeviceGuard() as guard:
        def encode(x: torch.Tensor, kind: str, *a: Any, **kw: Any) -> Any:
            seen.append("device" if guard.on_device(x) else "host")
            return real_encode(x, kind, *a, **kw)

        def decode(enc: Any, *a: Any, **kw: Any) -> Any:
            seen.append("device" if guard.on_device(enc.anchor) else "host")
            return real_decode(enc, *a, **kw)

        monkeypatch.setattr(codec, "encode", encode)
        monkeypatch.setattr(codec, "decode", decode)
        monkeypatch.setattr(transport_codec, "_fast_module", lambda codec, config, device: None)
        k_dev, v_dev = [guard.put(x.clone()) for x in k], [guard.put(x.clone()) for x in v]
        anchor, residual = transport_codec.encode_request_streams(k_dev, v_dev, codec, config)
        pools = {name: [guard.put(torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16)) for _ in range(LAYERS)]
                 for name in ("k", "v")}
        transport_codec.decode_request_streams(guard.put(anchor.clone()), None, pools["k"], pools["v"], slots, codec,
                                               config)
        transport_codec.decode_request_streams(anchor, residual, pools["k"], pools["v"], slots, codec, config)
        assert guard.violations == [], guard.violations
        assert all(guard.on_device(p) for p in pools["k"] + pools["v"])
    assert seen == ["host"] * (2 * LAYERS + 4 * LAYERS), seen
    assert torch.equal(anchor, want.anchor) and torch.equal(residual, want.residual)
    ref_k = [torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ref_v = [torch.zeros(TOKENS + 10, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    decode_request_into((want.anchor, want.residual), ref_k, ref_v, slots, with_residual=True, codec=codec)
    for got, ref in zip(pools["k"] + pools["v"], ref_k + ref_v, strict=True):
        assert torch.equal(got, ref)


def test_a_cuda_prefill_streams_its_chunks_through_the_device_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``page_range_encoder`` on a CUDA pool is the kernel module's page encoder: a request streamed in
    three chunks (the KV rows and the residual scratch on the device, the anchor and body in the host send
    region) gives the whole-request bytes; the kernels only ever see device tensors."""
    from sglang_lynx.kernels import lynx_cpu_pages

    from sglang_lynx.codec.stream_parts import PartEncoder
    from sglang_lynx.codec.wire_residual import residual_to_wire

    config = LynxConfig(mode="lynx")
    codec = get_codec(config.codec_name, **config.codec_params())
    k, v = _kv(4)
    want = encode_request(k, v, codec)
    with DeviceGuard() as guard:
        kernels = KernelsOnDevice(guard)
        kernels.encode_pages_into = lambda x, kind, first, count, a, r, **kw: kernels._real(  # type: ignore[attr-defined]
            lynx_cpu_pages.encode_pages_into, [x, a, r], x, kind, first, count, a, r, **kw)
        monkeypatch.setattr(transport_codec, "_fast_module", lambda codec, config, device: (
            kernels if device.type == "cuda" else None))
        encoder = transport_codec.page_range_encoder(codec, config, torch.device("cuda"))
        assert isinstance(encoder, transport_codec.KernelPageEncoder)
        parts = PartEncoder(encoder, LAYERS, TOKENS, HEADS, DIM)
        k_rows = [guard.put(torch.zeros_like(x)) for x in k]
        v_rows = [guard.put(torch.zeros_like(x)) for x in v]
        scratch = parts.new_scratch(torch.device("cuda"))
        assert guard.on_device(scratch)
        anchor = torch.zeros(parts.anchor_bytes, dtype=torch.uint8)  # the pinned send region: host memory
        body = torch.zeros(parts.body_bytes, dtype=torch.uint8)
        received = 0
        for end in (120, 256, TOKENS):
            for src, dst in zip(k + v, k_rows + v_rows, strict=True):
                dst[received:end] = guard.put(src[received:end].clone())
            received = end
            if parts.encodable_pages(received) > parts.next_page or received >= TOKENS:  # 120: no page complete
                parts.encode_part(k_rows, v_rows, parts.encodable_pages(received), received >= TOKENS, anchor,
                                  scratch, body)
        assert guard.violations == [], guard.violations
    assert parts.done and kernels.calls == 2 * LAYERS * 2  # K and V of each layer, in two parts (pages 0, then 1)
    assert torch.equal(anchor, want.anchor)
    assert torch.equal(body, residual_to_wire(want.residual, codec, LAYERS, TOKENS, HEADS, DIM))
