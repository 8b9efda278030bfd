"""Paged KV (``--page-size N`` on both servers) in a real PD deployment: default model, real Mooncake on
loopback, the decode on SGLang's default (overlap) loop, ``SGLANG_LYNX_TEST_HOOKS=1``, both ends dumping the
KV (``SGLANG_LYNX_DEBUG_DUMP_DIR``).

SGLang's PD transfer then names pages, not token slots; both Lynx ends turn them into the request's
token slots (``integration/transport/pages.py``). One deployment per case (module-scoped,
parametrised: pytest runs one case's tests, stops its servers, then starts the next):

- ``page64-lynx`` (mode ``lynx``, fp32, ``--page-size 64``, layer groups off): the decode KV (anchor-only and full)
  equals the codec reconstruction of the prefill KV byte for byte, for a prompt whose length is not a
  multiple of 64 (its last page is partial); a second request sharing a radix-cached prefix reuses
  the first one's encoded pages and its KV is still byte-equal; greedy outputs with the residual
  landing before, during and after the drafts (hold 0 / 8 / 64) are token-identical to ``lynx-int8``
  decoding (hold 0: the residual verified before any draft, i.e. decoding on the upgraded KV written
  by ``decode_request_into(with_residual=True)``, the ``lynx-int8`` receiver's function), drafts
  crossing page boundaries and rollbacks to mid-page lengths included; the decode's KV pool and both
  staging arenas back to idle after.
- ``page16-kivi-int2`` (``--page-size 16``, a one-stream baseline codec with its own full-precision
  window, the default layer groups: each one-chunk prompt is layered): the same byte-equality check.
- ``page16-lynx-chunked`` (``--page-size 16 --chunked-prefill-size 128``, ``stream_layer_group: 8``): every
  prompt is prefilled in chunks, so its KV is **streamed** while the prefill runs: a prompt the prefill
  has not cached is **layered** (``transport/prefill_layers.py``: each group of 8 layers' complete codec
  pages queued as soon as the forward has written them), one whose prefix is radix-cached goes chunk by
  chunk (``transport/prefill_stream.py``); either way the decode KV (anchor-only and full) is still the
  codec reconstruction byte for byte and the greedy output with drafts equals ``lynx-int8``'s. Streamed
  requests do not use the encoded-page cache.
- ``page64-lynx-exact-chunked``: the same in mode ``lynx-exact`` on a bf16 pool at ``--page-size 64`` (chunks of
  128 tokens = two pages): the exact stream goes in
  pieces, one set per part (``codec.exact_request``); the decode KV after the three streams is the
  prefill's KV bit for bit and the greedy output with drafts equals the output with the streams verified
  before any draft (plain decoding on that KV).

Page size 1 runs the same byte-equality check in ``test_lynx_pd_int8.py`` and ``test_lynx_shapes.py``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS, scoped_env
from pd_requests import last, pd_generate, settled_state
from sglang_lynx.config import LynxConfig
from sglang_lynx.launch.client import haystack
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.server_state import idle_problems, lynx_state

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

# the residual is held for up to 64 drafts: on a loaded 2-core host that took more than 20 s (the late-
# residual fallback then answered instead: a timing artefact, not what this module checks)
TIMEOUTS = {"residual_timeout_s": 180.0, "transfer_timeout_s": 900.0}


@dataclass(frozen=True)
class Case:
    name: str
    page_size: int
    config: dict[str, Any]
    lossless: bool  # run the speculative (mode lynx) checks
    chunked_prefill: int = 0  # --chunked-prefill-size (0: SGLang's default, longer than every prompt here)
    holds: tuple[int, ...] = (0, 8, 64)  # the residual holds the lossless checks run
    dtype: str = "float32"  # --dtype (the KV pool's)


CASES = [Case("page64-lynx", 64, {"mode": "lynx", "stream_layer_group": 0, **TIMEOUTS}, True),
         Case("page16-kivi-int2", 16, {"mode": "kivi-int2", **TIMEOUTS}, False),
         Case("page16-lynx-chunked", 16, {"mode": "lynx", "stream_layer_group": 8, **TIMEOUTS}, True,
              chunked_prefill=128, holds=(8,)),
         Case("page64-lynx-exact-chunked", 64, {"mode": "lynx-exact", "stream_layer_group": 8, **TIMEOUTS}, True,
              chunked_prefill=128, holds=(8,), dtype="bfloat16")]
CLIENT_TIMEOUT_S = 600.0
DUMP_WAIT_S = 60.0
MAX_NEW = 72
HOLDS = (0, 8, 64)  # the residual lands before, during and after the drafts
# ~330 tokens each: longer than the codec's full-precision trailer, so the drafts run on quantized KV
PROMPTS = [" ".join(haystack(260, seed=seed)) + "\n\nOnce upon a time, in a small village," for seed in (11, 12)]


@dataclass
class Deployment:
    case: Case
    pd: PDDeployment
    dump_dir: Path
    idle: dict[str, dict[str, Any]]  # the settled Lynx state of each server after the warm-up


def _direct(pd: PDDeployment, prompt: str, max_new: int, hold: int | None = None,
            room: int | None = None) -> dict[str, Any]:
    """One greedy request straight to the pair (the router drops ``custom_params``); the decode's answer."""
    sampling: dict[str, Any] = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    if hold is not None:
        sampling["custom_params"] = {"lynx_test_hold_residual_drafts": hold}
    return pd_generate(pd, {"text": prompt, "sampling_params": sampling}, CLIENT_TIMEOUT_S, room=room)


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def paged(request: pytest.FixtureRequest, model_path: str, tmp_path_factory: pytest.TempPathFactory,
          deployment_logs: Path) -> Iterator[Deployment]:
    from sglang_lynx.integration.transport.wire import DUMP_ENV

    case: Case = request.param
    dump_dir = tmp_path_factory.mktemp(f"dump-{case.name}")
    args = [*TEST_SERVER_ARGS, "--dtype", case.dtype, "--page-size", str(case.page_size),
            "--lynx", "--lynx-config", json.dumps(case.config)]
    if case.chunked_prefill:
        args += ["--chunked-prefill-size", str(case.chunked_prefill)]
    with scoped_env({"SGLANG_LYNX_TEST_HOOKS": "1", DUMP_ENV: str(dump_dir)}):
        deployment = PDDeployment(model_path, extra_args=args, log_dir=deployment_logs / f"pd-{case.name}")
        with deployment:
            deployment.start(timeout_s=START_TIMEOUT_S)
            _direct(deployment, "Hello", 2)  # warm-up
            idle = {"decode": settled_state(deployment.decode_url),
                    "prefill": lynx_state(deployment.prefill_url) or {}}
            yield Deployment(case, deployment, dump_dir, idle)


def _wait_for(path: Path) -> Path:
    """``path`` once it exists and its size held still over half a second (the writer finished)."""
    deadline, size = time.monotonic() + DUMP_WAIT_S, -1
    while time.monotonic() < deadline:
        now = path.stat().st_size if path.is_file() else -1
        if now > 0 and now == size:
            return path
        size = now
        time.sleep(0.5)
    raise AssertionError(f"{path.name} was not (completely) written within {DUMP_WAIT_S:.0f} s")


def _assert_byte_equal(d: Deployment, room: int, prompt_tokens: int, stages: tuple[str, ...]) -> None:
    """The decode's KV of request ``room`` at each stage == the codec reconstruction of the prefill's
    (``lynx-exact``'s full stage: the prefill's KV itself, bit for bit)."""
    from sglang_lynx.codec.registry import get_codec

    sent = torch.load(_wait_for(d.dump_dir / f"prefill-{room}.pt"))
    config = LynxConfig(**d.case.config)
    codec = get_codec(config.codec_name, **config.codec_params())
    assert sent["k"][0].shape[0] == prompt_tokens, (sent["k"][0].shape, prompt_tokens)  # no page tail sent
    for stage in stages:
        written = torch.load(_wait_for(d.dump_dir / f"decode-{room}-{stage}.pt"))
        exact = config.mode == "lynx-exact" and stage == "full"
        changed = False
        for kind in ("k", "v"):
            for layer, (x, y) in enumerate(zip(sent[kind], written[kind], strict=True)):
                if exact:
                    expected = x
                else:
                    enc = codec.encode(x, kind, layer=layer)
                    expected = codec.decode(enc, with_residual=stage == "full", dtype=y.dtype)
                assert expected.dtype == y.dtype == getattr(torch, d.case.dtype) and expected.shape == y.shape
                assert torch.equal(expected.view(torch.uint8), y.view(torch.uint8)), (d.case.name, stage, kind, layer)
                changed = changed or not torch.equal(x, y)
        assert changed != exact, f"{d.case.name} {stage}: the decode side holds {'other' if exact else 'the raw'} KV"


def test_decode_kv_is_the_codec_reconstruction_with_a_partial_last_page(paged: Deployment) -> None:
    d, page = paged, paged.case.page_size
    room = random.randint(0, 2**63 - 1)
    hold = 16 if d.case.lossless else None
    got = _direct(d.pd, PROMPTS[0], 24, hold, room)
    tokens = got["meta_info"]["prompt_tokens"]
    assert tokens % page != 0, f"pick a prompt whose length ({tokens}) is not a multiple of {page}"
    stages = ("anchor", "full") if d.case.lossless else ("full",)
    if d.case.lossless:
        assert last(got["meta_info"], "lynx_drafts") == 16, got["meta_info"]
    _assert_byte_equal(d, room, tokens, stages)
    state = lynx_state(d.pd.prefill_url) or {}
    streamed, layered = state.get("requests_streamed", 0), state.get("requests_layered", 0)
    layers = bool(LynxConfig(**d.case.config).stream_layer_group)
    assert (layered > 0) == layers, (d.case.name, layered)  # layered iff layer groups are on
    assert (streamed > 0) == (layers or bool(d.case.chunked_prefill)), (d.case.name, streamed)  # or chunked
    print(f"\n[paged] {d.case.name}: decode KV ({', '.join(stages)}) == codec reconstruction, {tokens} tokens "
          f"= {tokens // page} full pages of {page} + {tokens % page}")


def test_a_shared_prefix_reuses_encoded_pages(paged: Deployment) -> None:
    d = paged
    if d.case.chunked_prefill:
        _a_cached_prefix_is_streamed_chunk_by_chunk(d)
        return
    if LynxConfig(**d.case.config).stream_layer_group:
        pytest.skip(f"{d.case.name}: layered requests are encoded as they are computed, without the page cache")

    def page_cache() -> dict[str, Any]:
        state = lynx_state(d.pd.prefill_url)
        assert state is not None and "page_cache" in state, state
        return state["page_cache"]

    prefix = " ".join(f"Log {i}: the keeper of the north light trimmed wick {i} at dusk." for i in range(45))
    first = _direct(d.pd, prefix + " Which wick was trimmed first?", 4)
    assert first["meta_info"]["prompt_tokens"] > 600, first["meta_info"]  # two full 256-token codec pages
    before = page_cache()
    assert before["enabled"] is True and before["entries"] > 0, before
    room = random.randint(0, 2**63 - 1)
    second = _direct(d.pd, prefix + " Which wick was trimmed last?", 4, room=room)
    after = page_cache()
    assert after["hits"] - before["hits"] >= 2, (before, after)  # whole codec pages of every layer
    assert after["stale"] == before["stale"], (before, after)
    _assert_byte_equal(d, room, second["meta_info"]["prompt_tokens"], ("full",))  # reused bytes are its KV's


def _a_cached_prefix_is_streamed_chunk_by_chunk(d: Deployment) -> None:
    """Chunked case (layer groups on): a prompt whose prefix the prefill holds is layered too (the prefix's
    rows of every layer copied when its first chunk's forward starts); one kept off layer groups (the
    ``per_chunk`` test hook) is streamed chunk by chunk; the KV of both is still the codec's."""
    prefix = " ".join(f"Log {i}: the keeper of the south light trimmed wick {i} at dusk." for i in range(45))
    _direct(d.pd, prefix + " Which wick was trimmed first?", 4)
    for until, fault, layered in (("dawn", None, 1), ("noon", "per_chunk", 0)):
        suffix = " ".join(f"Note {i}: wick {i} burned until {until}." for i in range(30))  # longer than a chunk
        before = lynx_state(d.pd.prefill_url) or {}
        room = random.randint(0, 2**63 - 1)
        sampling: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        if fault is not None:
            sampling["custom_params"] = {"lynx_test_prefill_fault": fault}
        got = pd_generate(d.pd, {"text": prefix + " " + suffix + " Which wick was trimmed last?",
                                 "sampling_params": sampling},
                          CLIENT_TIMEOUT_S, room=room)
        after = lynx_state(d.pd.prefill_url) or {}
        assert after["requests_streamed"] == before["requests_streamed"] + 1, (fault, before, after)
        assert after["requests_layered"] == before["requests_layered"] + layered, (fault, before, after)
        _assert_byte_equal(d, room, got["meta_info"]["prompt_tokens"], ("full",))


@pytest.fixture(scope="module")
def reference(paged: Deployment) -> dict[str, list[int]]:
    """Each prompt with the residual verified before any draft (hold 0): ``lynx-int8`` decoding (``lynx-exact``:
    decoding on the prefill's exact KV)."""
    if not paged.case.lossless:
        pytest.skip(f"{paged.case.name}: no speculation in mode {paged.case.config['mode']}")
    out = {}
    for prompt in PROMPTS:
        got = _direct(paged.pd, prompt, MAX_NEW, 0)
        assert last(got["meta_info"], "lynx_drafts") == 0, got["meta_info"]
        out[prompt] = got["output_ids"]
    assert all(len(set(ids)) > 3 for ids in out.values()), f"degenerate greedy outputs: {out}"
    return out


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_residual_before_during_after_drafts_is_lossless(paged: Deployment, reference: dict[str, list[int]],
                                                         prompt_index: int, hold: int) -> None:
    if hold not in paged.case.holds:
        pytest.skip(f"{paged.case.name}: holds {paged.case.holds} only")
    prompt = PROMPTS[prompt_index]
    got = _direct(paged.pd, prompt, MAX_NEW, hold)
    meta = got["meta_info"]
    drafts, accepted = last(meta, "lynx_drafts"), last(meta, "lynx_accepted")
    tokens = meta["prompt_tokens"]
    print(f"\n[paged] {paged.case.name} prompt {prompt_index} ({tokens} tokens) hold {hold}: {drafts} drafts, "
          f"{accepted} accepted")
    assert drafts == hold, meta  # ignore_eos and MAX_NEW > 1 + 64: the window closes at the hold (64: the cap)
    assert 0 <= accepted <= drafts
    assert last(meta, "lynx_fallback") in (None, ""), meta
    assert got["output_ids"] == reference[prompt], (prompt_index, hold, meta)


def test_pool_and_staging_back_to_idle(paged: Deployment) -> None:
    d = paged
    _direct(d.pd, "Hello", 2)
    decode = settled_state(d.pd.decode_url)
    assert idle_problems(decode, d.idle["decode"]) == [], (decode, d.idle["decode"])
    prefill = lynx_state(d.pd.prefill_url)
    assert prefill is not None
    staging = prefill["staging"]
    assert staging["free_bytes"] == staging["arena_bytes"] and not staging["leases"], staging
    assert not prefill.get("pending_requests") and not prefill.get("transfers_in_progress"), prefill
