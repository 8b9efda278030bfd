"""The Lynx transport inside a real PD deployment (prefill + decode + router, default model,
real Mooncake on loopback), mode ``lynx-int8``.

- ``lynx-int8`` (anchor + residual, two prioritised streams): the KV the decode side writes into its
  pool equals the codec's reconstruction of the KV the prefill side sent, byte for byte (both ends
  dump it when SGLANG_LYNX_DEBUG_DUMP_DIR is set), and completions come back through the router.
- A second request that shares a radix-cached prefix reuses the first one's encoded pages (the
  prefill's page-cache hits grow by whole pages of every layer) and its decode KV is still the
  reconstruction of its own prefill KV byte for byte; ``/flush_cache`` empties the page cache.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from lynx_testlib import start_pd
from sglang_lynx.launch.client import generate

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea:",
    "def add(a, b):",
]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lynx-dump")


@pytest.fixture(scope="module")
def pd_lynx_int8(model_path: str, deployment_logs: Path, dump_dir: Path):
    from sglang_lynx.integration.transport.wire import DUMP_ENV

    os.environ[DUMP_ENV] = str(dump_dir)
    try:
        # layer groups off: requests are buffered, so a cached prefix's encoded pages are reused
        yield from start_pd(model_path, deployment_logs / "pd-lynx-int8",
                            json.dumps({"mode": "lynx-int8", "stream_layer_group": 0}))
    finally:
        os.environ.pop(DUMP_ENV, None)


def _wait_for(path_glob: str, directory: Path, timeout_s: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(directory.glob(path_glob))
        if found:
            return found
        time.sleep(0.5)
    return []


def _assert_decode_kv_is_the_reconstruction(prefill_dump: Path, dump_dir: Path) -> None:
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.config import LynxConfig

    room = prefill_dump.stem.split("-", 1)[1]
    decode_dump = _wait_for(f"decode-{room}-full.pt", dump_dir)
    assert decode_dump, f"the decode side wrote no full KV for request {room}"
    sent = torch.load(prefill_dump)
    assert sent["k"][0].shape[0] > 100
    written = torch.load(decode_dump[0])
    config = LynxConfig(mode="lynx-int8")
    codec = get_codec(config.codec_name, **config.codec_params())
    changed = False
    for kind in ("k", "v"):
        for layer, (x, y) in enumerate(zip(sent[kind], written[kind], strict=True)):
            enc = codec.encode(x, kind, layer=layer)
            expected = codec.decode(enc, with_residual=True, dtype=y.dtype)
            assert expected.dtype == y.dtype and expected.shape == y.shape
            assert torch.equal(expected.view(torch.uint8), y.view(torch.uint8)), (kind, layer)  # byte for byte
            changed = changed or not torch.equal(x, y)
    assert changed, "the decode side holds the raw KV: nothing was quantized"


def test_lynx_int8_decode_kv_is_the_codec_reconstruction(pd_lynx_int8, dump_dir: Path) -> None:
    out = generate(pd_lynx_int8.url, "Tell me about lighthouses. " * 40, max_new_tokens=8)
    assert out["output_ids"], out
    prefill_dumps = _wait_for("prefill-*.pt", dump_dir)
    assert prefill_dumps, "the prefill side sent no Lynx request"
    biggest = max(prefill_dumps, key=lambda p: p.stat().st_size)  # this prompt, not the 1-token warm-up
    _assert_decode_kv_is_the_reconstruction(biggest, dump_dir)


def test_lynx_int8_reuses_the_encoded_pages_of_a_cached_prefix(pd_lynx_int8, dump_dir: Path) -> None:
    import urllib.error
    import urllib.request

    from sglang_lynx.launch.server_state import lynx_state

    def page_cache() -> dict:
        state = lynx_state(pd_lynx_int8.prefill_url)
        assert state is not None and "page_cache" in state, state
        return state["page_cache"]

    prefix = " ".join(f"Log {i}: the keeper of the north light trimmed wick {i} at dusk." for i in range(45))
    first = generate(pd_lynx_int8.url, prefix + " Which wick was trimmed first?", max_new_tokens=4)
    assert first["output_ids"], first
    assert first["meta_info"]["prompt_tokens"] > 600, first["meta_info"]  # at least two full 256-token pages
    before = page_cache()
    assert before["enabled"] is True and before["entries"] > 0, before
    second = generate(pd_lynx_int8.url, prefix + " Which wick was trimmed last?", max_new_tokens=4)
    assert second["output_ids"], second
    after = page_cache()
    dumps = sorted(dump_dir.glob("prefill-*.pt"), key=lambda p: p.stat().st_mtime)
    hits = after["hits"] - before["hits"]
    assert hits >= 2, (before, after)  # whole pages (one entry holds k and v of every layer)
    assert after["stale"] == before["stale"] and after["requests_keyed"] == before["requests_keyed"] + 1
    _assert_decode_kv_is_the_reconstruction(dumps[-1], dump_dir)  # the reused bytes are this request's KV's

    deadline = time.monotonic() + 60
    while True:  # SGLang refuses to flush (400) while the scheduler still holds a request
        try:
            request = urllib.request.Request(f"{pd_lynx_int8.prefill_url}/flush_cache", method="POST")
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.status == 200
            break
        except urllib.error.HTTPError as exc:
            assert exc.code == 400 and time.monotonic() < deadline, exc
            time.sleep(1.0)
    flushed = page_cache()
    assert flushed["entries"] == 0 and flushed["invalidated"] >= after["entries"], flushed


def test_lynx_int8_serves_many_requests(pd_lynx_int8) -> None:
    outputs = [generate(pd_lynx_int8.url, p, max_new_tokens=12) for p in PROMPTS]
    assert all(o["output_ids"] for o in outputs)
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outputs)
