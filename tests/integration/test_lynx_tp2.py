"""Tensor parallelism with ``--lynx``: a PD pair at ``--tp-size 2`` on both servers (SGLang's CPU TP, gloo
all-reduce, the default model's 3 KV heads padded to 4: rank 0 heads 0-1, rank 1 head 2 and an
all-zero head), real Mooncake on loopback, fp32, SGLang's default (overlap) decode loop,
``SGLANG_LYNX_TEST_HOOKS=1``. Each TP rank runs its own Lynx side and moves its own heads' streams; the
ranks agree on every per-request decision.

One ``lynx`` pair (4 scheduler processes on a 2-core host), shared by the tests:

1. the residual verified before any draft (``lynx_test_hold_residual_drafts`` 0): the request decodes
   on the upgraded KV, i.e. exactly ``lynx-int8`` decoding (the reference). Per rank, the KV the decode
   rank wrote into its pool, anchor-only at admission and full after the upgrade, equals the codec
   reconstruction of the KV the prefill rank of the same index sent, byte for byte (both ends dump
   it, ``r<rank>-`` in the names); rank 1's padded head is all zeros on both ends.
2. the residual during and after the drafts (hold 8 / 64): greedy outputs equal the reference token for
   token; the draft and accepted counts are reported; every rank returns to idle.

Then one ``lynx-exact`` pair (bf16 pool, ``exact_threads`` 2: the exact stream's pieces coded on a pool of
threads on both ends), shared by its tests:

1. the streams verified before any draft (hold 0): per rank, the decode KV at admission equals the anchor
   reconstruction of what the prefill rank sent, and after the three streams it equals the prefill rank's
   KV bit for bit (the padded head: zeros on both ends);
2. drafts on the anchor, then the residual's upgrade, then the exact verify (hold 8): the same greedy
   tokens as hold 0; every rank returns to idle.

In-process (no server): the padded all-zero head round-trips the codec exactly.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS, scoped_env
from pd_requests import last, pd_generate
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.server_state import IDLE_KEYS, idle_problems, lynx_state

TP_ARGS = [*TEST_SERVER_ARGS, "--max-total-tokens", "4096", "--tp-size", "2"]
LYNX = {"mode": "lynx", "residual_timeout_s": 60.0, "transfer_timeout_s": 900.0}
EXACT = {**LYNX, "mode": "lynx-exact", "exact_threads": 2}
EXACT_HOLD = 8
ENV = {"SGLANG_LYNX_TEST_HOOKS": "1"}
# ~150 tokens each: longer than the codec's 48-token full-precision trailer, short for TP 2 on 2 cores
PROMPTS = [
    "The lighthouse keeper wrote in his log every evening. " * 14 + "On the last page he wrote:",
    "A list of rivers, mountains and the towns beside them, one per line. " * 12 + "The next one is",
]
MAX_NEW = 24
HOLDS = (0, 8, 64)
CLIENT_TIMEOUT_S = 900.0
IDLE_WAIT_S = 180.0


def _payload(prompt: str, hold: int | None = None) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    if hold is not None:
        sampling["custom_params"] = {"lynx_test_hold_residual_drafts": hold}
    return {"text": prompt, "sampling_params": sampling}


def _rank_states(url: str) -> list[dict[str, Any]]:
    state = lynx_state(url)
    assert state is not None, f"{url}: no lynx block in /get_server_info"
    ranks = state.get("tp_ranks")
    assert isinstance(ranks, list) and len(ranks) == 2 and all(isinstance(r, dict) for r in ranks), state
    assert [r["tp_rank"] for r in ranks] == [0, 1] and {r["tp_size"] for r in ranks} == {2}, ranks
    return ranks


def _settled(url: str) -> list[dict[str, Any]]:
    """Every rank's Lynx state once nothing is in flight and the decode ranks' free KV counts are stable."""
    deadline, previous = time.monotonic() + IDLE_WAIT_S, None
    while time.monotonic() < deadline:
        ranks = _rank_states(url)
        quiet = all(not any(r.get(k) for k in IDLE_KEYS) and not r.get("live_transfers") for r in ranks)
        if quiet:
            free = [r["kv_pool_free_tokens"] for r in ranks]
            if ranks[0]["role"] == "prefill" or free == previous:
                return ranks
            previous = free
        time.sleep(1.0)
    raise AssertionError(f"{url} did not settle within {IDLE_WAIT_S:.0f} s: {lynx_state(url)}")


def _assert_idle(pd: PDDeployment, baseline: dict[str, list[dict[str, Any]]]) -> None:
    for url in (pd.prefill_url, pd.decode_url):
        for rank, (now, before) in enumerate(zip(_settled(url), baseline[url], strict=True)):
            assert idle_problems(now, before) == [], (url, rank, idle_problems(now, before))


def _start(model_path: str, log_dir: Path, config: dict[str, Any], env: dict[str, str],
           dtype: str = "float32") -> Iterator[PDDeployment]:
    args = [*TP_ARGS, "--dtype", dtype, "--lynx", "--lynx-config", json.dumps(config)]
    with scoped_env({**ENV, **env}):
        deployment = PDDeployment(model_path, extra_args=args, log_dir=log_dir)
        with deployment:
            deployment.start(timeout_s=START_TIMEOUT_S)
            pd_generate(deployment, _payload("Hello", 0), CLIENT_TIMEOUT_S)  # warm both ranks once
            yield deployment


def _wait_for(pattern: str, directory: Path, timeout_s: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if found:
            return found
        time.sleep(0.5)
    return []


def _kv_comparison(dump_dir: Path, room: int, rank: int, mode: str = "lynx") -> dict[str, Any]:
    """Decode rank ``rank``'s written KV of request ``room`` against the codec reconstruction of what
    prefill rank ``rank`` sent (``lynx-exact`` after its three streams: that KV itself): bytes equal per
    layer, whether the anchor stage differs from the sent KV, and what the padded head holds."""
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.config import LynxConfig

    sent_path = _wait_for(f"prefill-r{rank}-{room}.pt", dump_dir)
    assert sent_path, (rank, room, sorted(p.name for p in dump_dir.iterdir()))
    sent = torch.load(sent_path[0])
    config = LynxConfig(mode=mode)
    codec = get_codec(config.codec_name, **config.codec_params())
    equal, quantized, shape = True, False, tuple(sent["k"][0].shape)
    padded_zero = True
    for stage, with_residual in (("anchor", False), ("full", True)):
        exact = mode == "lynx-exact" and stage == "full"
        written_path = _wait_for(f"decode-r{rank}-{room}-{stage}.pt", dump_dir)
        assert written_path, (rank, room, stage, sorted(p.name for p in dump_dir.iterdir()))
        written = torch.load(written_path[0])
        for kind in ("k", "v"):
            for layer, (x, y) in enumerate(zip(sent[kind], written[kind], strict=True)):
                expected = x if exact else codec.decode(codec.encode(x, kind, layer=layer),
                                                        with_residual=with_residual, dtype=y.dtype)
                equal = equal and expected.shape == y.shape and torch.equal(expected.view(torch.uint8),
                                                                            y.view(torch.uint8))
                quantized = quantized or (stage == "anchor" and not torch.equal(x, y))
                padded_zero = padded_zero and bool((x[:, -1] == 0).all()) and bool((y[:, -1] == 0).all())
    return {"equal": equal, "quantized": quantized, "shape": shape, "last_head_zero": padded_zero}


@pytest.fixture(scope="module")
def lynx_run(model_path: str, deployment_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Everything the TP-2 ``lynx`` pair answered (the pair is stopped when this returns): the hold-0
    reference outputs and KV comparisons, then the held runs, then whether every rank went idle."""
    from sglang_lynx.integration.transport.wire import DUMP_ENV

    dump_dir = tmp_path_factory.mktemp("tp2-dump")
    results: dict[str, Any] = {"outputs": {}, "kv": {}, "held": [], "idle": []}
    for pd in _start(model_path, deployment_logs / "tp2-lynx", LYNX, {DUMP_ENV: str(dump_dir)}):
        baseline = {url: _settled(url) for url in (pd.prefill_url, pd.decode_url)}
        for i, prompt in enumerate(PROMPTS):
            room = 1000 + i
            got = pd_generate(pd, _payload(prompt, 0), CLIENT_TIMEOUT_S, room=room)
            assert len(got["output_ids"]) == MAX_NEW and last(got["meta_info"], "lynx_drafts") == 0, got
            results["outputs"][prompt] = list(got["output_ids"])
            results["kv"][room] = [_kv_comparison(dump_dir, room, rank) for rank in (0, 1)]
        for hold in HOLDS[1:]:
            for prompt in PROMPTS:
                got = pd_generate(pd, _payload(prompt, hold), CLIENT_TIMEOUT_S)
                results["held"].append((hold, prompt, list(got["output_ids"]), got["meta_info"]))
        try:
            _assert_idle(pd, baseline)
        except AssertionError as exc:
            results["idle"].append(str(exc))
    return results


def test_the_padded_zero_head_round_trips_the_codec_exactly() -> None:
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.config import LynxConfig

    for mode in ("lynx-int8", "lynx"):
        config = LynxConfig(mode=mode)
        codec = get_codec(config.codec_name, **config.codec_params())
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(300, 2, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
            x[:, 1] = 0
            enc = codec.encode(x, "v", layer=0)
            for with_residual in (False, True):
                y = codec.decode(enc, with_residual=with_residual, dtype=dtype)
                assert torch.equal(y[:, 1].view(torch.uint8), torch.zeros_like(y[:, 1]).view(torch.uint8)), \
                    (mode, dtype, with_residual)  # +0.0 bit for bit
                assert not torch.equal(y[:, 0], torch.zeros_like(y[:, 0]))


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tp2_decode_kv_is_each_ranks_reconstruction(lynx_run: dict[str, Any]) -> None:
    assert len(lynx_run["kv"]) == len(PROMPTS)
    for room, ranks in lynx_run["kv"].items():
        for rank, found in enumerate(ranks):
            tokens, heads, dim = found["shape"]
            assert tokens > 100 and heads == 2 and dim == 64, (room, rank, found)
            assert found["equal"], f"request {room}, rank {rank}: decode KV != reconstruction of the prefill KV"
            assert found["quantized"], f"request {room}, rank {rank}: the raw KV arrived, nothing was quantized"
        # rank 1's second head is SGLang's padding of the 3 KV heads to 4: zero on both ends
        assert ranks[1]["last_head_zero"] and not ranks[0]["last_head_zero"], (room, ranks)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tp2_lynx_equals_lynx_int8_with_the_residual_before_during_and_after_the_drafts(
        lynx_run: dict[str, Any]) -> None:
    report = []
    for hold, prompt, output_ids, meta in lynx_run["held"]:
        drafts, accepted = last(meta, "lynx_drafts"), last(meta, "lynx_accepted")
        report.append((hold, PROMPTS.index(prompt), drafts, accepted, last(meta, "lynx_fallback")))
        assert output_ids == lynx_run["outputs"][prompt], (hold, PROMPTS.index(prompt), meta)
        assert last(meta, "lynx_fallback") in (None, ""), meta
        assert drafts is not None and drafts >= min(hold, MAX_NEW - 1), meta
        assert accepted is not None and 0 <= accepted <= drafts, meta
    assert len(report) == len(PROMPTS) * (len(HOLDS) - 1)
    print("TP 2 lynx (hold, prompt, drafts, accepted, fallback):", report)
    assert lynx_run["idle"] == [], lynx_run["idle"]


def test_tp2_dump_names_are_per_rank() -> None:
    """Both TP ranks dump into one directory: the rank is in the name (none at TP 1)."""
    from sglang_lynx.integration.transport.wire import TpRank

    assert TpRank().dump_tag == "" and TpRank(1, 2).dump_tag == "r1-" and TpRank(0, 2).dump_tag == "r0-"
    assert os.sep not in TpRank(1, 2).dump_tag


@pytest.fixture(scope="module")
def exact_run(lynx_run: dict[str, Any], model_path: str, deployment_logs: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the TP-2 ``lynx-exact`` pair answered (started after the ``lynx`` pair has stopped: one pair of
    4 scheduler processes at a time on this host): hold 0 with both ranks' KV compared, then hold 8."""
    from sglang_lynx.integration.transport.wire import DUMP_ENV

    dump_dir = tmp_path_factory.mktemp("tp2-exact-dump")
    results: dict[str, Any] = {"idle": []}
    for pd in _start(model_path, deployment_logs / "tp2-lynx-exact", EXACT, {DUMP_ENV: str(dump_dir)}, "bfloat16"):
        baseline = {url: _settled(url) for url in (pd.prefill_url, pd.decode_url)}
        room = 2000
        got = pd_generate(pd, _payload(PROMPTS[0], 0), CLIENT_TIMEOUT_S, room=room)
        assert len(got["output_ids"]) == MAX_NEW and last(got["meta_info"], "lynx_drafts") == 0, got
        results["reference"] = list(got["output_ids"])
        results["kv"] = [_kv_comparison(dump_dir, room, rank, "lynx-exact") for rank in (0, 1)]
        results["held"] = pd_generate(pd, _payload(PROMPTS[0], EXACT_HOLD), CLIENT_TIMEOUT_S)
        try:
            _assert_idle(pd, baseline)
        except AssertionError as exc:
            results["idle"].append(str(exc))
    return results


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tp2_lynx_exact_decode_kv_is_each_ranks_prefill_kv_bit_for_bit(exact_run: dict[str, Any]) -> None:
    for rank, found in enumerate(exact_run["kv"]):
        tokens, heads, dim = found["shape"]
        assert tokens > 100 and heads == 2 and dim == 64, (rank, found)
        assert found["equal"], f"rank {rank}: decode KV (anchor: its reconstruction; full: exact) != the prefill's"
        assert found["quantized"], f"rank {rank}: the anchor stage held the raw KV, nothing was drafted on"
    assert exact_run["kv"][1]["last_head_zero"] and not exact_run["kv"][0]["last_head_zero"], exact_run["kv"]


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_tp2_lynx_exact_drafts_then_verifies_to_the_same_tokens(exact_run: dict[str, Any]) -> None:
    got = exact_run["held"]
    meta = got["meta_info"]
    drafts, accepted = last(meta, "lynx_drafts"), last(meta, "lynx_accepted")
    print(f"TP 2 lynx-exact hold {EXACT_HOLD}: {drafts} drafts, {accepted} accepted")
    assert last(meta, "lynx_fallback") in (None, ""), meta
    assert drafts == EXACT_HOLD and accepted is not None and 0 <= accepted <= drafts, meta
    assert list(got["output_ids"]) == exact_run["reference"], meta
    assert exact_run["idle"] == [], exact_run["idle"]
