"""Other model shapes in a real PD deployment: Llama-3, Qwen3 (q/k norms) and Mistral (full attention)
shapes with 8 KV heads of head_dim 128, small random checkpoints built from a config
(``python -m sglang_lynx.models build-shape``), mode ``lynx``, fp32, ``SGLANG_LYNX_TEST_HOOKS=1``,
both ends dumping the KV (``SGLANG_LYNX_DEBUG_DUMP_DIR``).

One deployment per shape (module-scoped, parametrised: pytest runs one shape's tests, stops its
servers, then starts the next), checked for:

- the KV the decode side writes into its pool equals the codec's reconstruction of the KV the
  prefill side sent, byte for byte: the anchor-only KV it drafts on (residual held for 16 drafts)
  and the full KV after the residual (``lynx`` puts the same anchor + residual bytes on the wire as
  ``lynx-int8``, whose receiver function ``decode_request_into(with_residual=True)`` writes the full KV);
- greedy outputs with the residual landing after 16 drafts are token-identical to the same
  deployment's reference, the residual verified before any draft (hold 0: decoding on the
  ``lynx-int8`` KV), on a few prompts longer than the codec's full-precision trailer.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS, scoped_env
from pd_requests import last, pd_generate
from sglang_lynx.launch.client import haystack
from sglang_lynx.launch.deployment import PDDeployment

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(2400)]

SHAPES = ["llama3-shape", "qwen3-shape", "mistral-shape"]
CONFIG = {"mode": "lynx", "residual_timeout_s": 20.0, "transfer_timeout_s": 900.0}
SERVER_ARGS = [*TEST_SERVER_ARGS, "--dtype", "float32", "--disable-overlap-schedule", "--max-total-tokens", "4096",
               "--lynx", "--lynx-config", json.dumps(CONFIG)]
# ~300 tokens each: longer than the codec's full-precision trailer, so the drafts run on quantized KV
PROMPTS = [" ".join(haystack(220, seed=seed)) + "\n\nOnce upon a time, in a small village," for seed in range(3)]
MAX_NEW = 32
HOLD = 16
CLIENT_TIMEOUT_S = 600.0
DUMP_WAIT_S = 60.0


def _direct(pd: PDDeployment, prompt: str, hold: int, room: int | None = None) -> dict[str, Any]:
    """One greedy request straight to the pair (the router drops ``custom_params``); the decode's answer."""
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
                "custom_params": {"lynx_test_hold_residual_drafts": hold}}
    return pd_generate(pd, {"text": prompt, "sampling_params": sampling}, CLIENT_TIMEOUT_S, room=room)


@pytest.fixture(scope="module", params=SHAPES)
def shape(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          deployment_logs: Path) -> Iterator[tuple[str, PDDeployment, Path]]:
    """(shape name, its PD pair, the pair's dump directory); the checkpoint is built on first use."""
    from sglang_lynx.integration.transport.wire import DUMP_ENV
    from sglang_lynx.models.shapes import build_shape

    name = request.param
    model = build_shape(name)
    dump_dir = tmp_path_factory.mktemp(f"dump-{name}")
    env = {"SGLANG_LYNX_TEST_HOOKS": "1", DUMP_ENV: str(dump_dir)}
    with scoped_env(env):
        deployment = PDDeployment(str(model), extra_args=list(SERVER_ARGS), log_dir=deployment_logs / f"pd-{name}")
        with deployment:
            deployment.start(timeout_s=START_TIMEOUT_S)
            _direct(deployment, "Hello", 0)  # warm-up
            yield name, deployment, dump_dir


@pytest.fixture(scope="module")
def reference(shape: tuple[str, PDDeployment, Path]) -> dict[str, list[int]]:
    """Each prompt alone with the residual verified before any draft (hold 0): lynx-int8 decoding."""
    _, pd, _ = shape
    out = {}
    for prompt in PROMPTS:
        got = _direct(pd, prompt, 0)
        assert last(got["meta_info"], "lynx_drafts") == 0, got["meta_info"]
        out[prompt] = got["output_ids"]
    assert len(set(map(tuple, out.values()))) == len(PROMPTS), "the prompts should give different outputs"
    assert all(len(set(ids)) > 3 for ids in out.values()), f"degenerate greedy outputs: {out}"
    return out


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


def test_decode_kv_is_the_codec_reconstruction(shape: tuple[str, PDDeployment, Path]) -> None:
    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.config import LynxConfig

    name, pd, dump_dir = shape
    room = random.randint(0, 2**63 - 1)
    got = _direct(pd, PROMPTS[0], HOLD, room)
    assert last(got["meta_info"], "lynx_drafts") == HOLD, got["meta_info"]
    sent = torch.load(_wait_for(dump_dir / f"prefill-{room}.pt"))
    config = LynxConfig(**CONFIG)  # type: ignore[arg-type]
    codec = get_codec(config.codec_name, **config.codec_params())
    assert sent["k"][0].shape[1:] == (8, 128), sent["k"][0].shape  # 8 KV heads x head_dim 128
    assert sent["k"][0].shape[0] > 250
    for stage, with_residual in (("anchor", False), ("full", True)):
        written = torch.load(_wait_for(dump_dir / f"decode-{room}-{stage}.pt"))
        changed = False
        for kind in ("k", "v"):
            assert len(sent[kind]) == len(written[kind]) == 3
            for layer, (x, y) in enumerate(zip(sent[kind], written[kind], strict=True)):
                enc = codec.encode(x, kind, layer=layer)
                expected = codec.decode(enc, with_residual=with_residual, dtype=y.dtype)
                assert expected.dtype == y.dtype == torch.float32 and expected.shape == y.shape
                assert torch.equal(expected.view(torch.uint8), y.view(torch.uint8)), (name, stage, kind, layer)
                changed = changed or not torch.equal(x, y)
        assert changed, f"{name} {stage}: the decode side holds the raw KV: nothing was quantized"
    print(f"\n[shapes] {name}: decode KV (anchor and full) == codec reconstruction, "
          f"{sent['k'][0].shape[0]} tokens x 3 layers")


@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_residual_after_drafts_is_lossless(shape: tuple[str, PDDeployment, Path], reference: dict[str, list[int]],
                                           prompt_index: int) -> None:
    name, pd, _ = shape
    prompt = PROMPTS[prompt_index]
    got = _direct(pd, prompt, HOLD)
    meta = got["meta_info"]
    drafts, accepted = last(meta, "lynx_drafts"), last(meta, "lynx_accepted")
    print(f"\n[shapes] {name} prompt {prompt_index}: {drafts} drafts, {accepted} accepted")
    assert drafts == HOLD, meta
    assert last(meta, "lynx_fallback") in (None, ""), meta
    assert got["output_ids"] == reference[prompt], (name, prompt_index, meta)
