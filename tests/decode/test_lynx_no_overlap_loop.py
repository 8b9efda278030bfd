"""Mode ``lynx`` on SGLang's other decode loop (``--disable-overlap-schedule``), in a real PD deployment.

The other decode-side server tests (``test_lynx_pd_speculative.py``, ``test_lynx_bf16_lossless.py``)
run the decode server on SGLang's default overlap loop; this module keeps the normal loop
(``event_loop_normal_disagg_decode``) tested with the same greedy requests: the residual landing
before, during and after the drafts (test hold 0 / 8 / 64), EOS, max tokens and a stop string inside
the draft window, each token-identical to ``lynx-int8`` decoding on the same loop, and the ``lynx`` decode
server back to idle after (KV pool, staging).

The reference is the one ``test_lynx_pd_speculative.py`` uses by default: the same deployment with the
residual verified before any draft (the request then decodes on KV upgraded by
``decode_request_into(with_residual=True)``, the ``lynx-int8`` receiver's function), so no second pair
is started for it; ``LYNX_DECODE_INT8_REFERENCE=1`` takes it from a real ``lynx-int8`` deployment on this
loop instead (started, queried and stopped before the ``lynx`` pair starts). The transfer-only modes'
decode path on this loop is run by the fault matrix, the shapes and the arena modules (fp32, this loop).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lynx_deployments import INT8_CONFIG, LYNX_CONFIG, NO_OVERLAP_ARGS, start_lynx_pd
from test_lynx_pd_speculative import SPECS, _run, verified_before_drafts

from pd_requests import last, settled_state
from sglang_lynx.launch.server_state import idle_problems

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

CASES = ["timing0", "timing8", "timing64", "eos", "max_tokens", "stop_string"]


@pytest.fixture(scope="module")
def int8_reference(model_path: str, deployment_logs: Path) -> dict[str, dict[str, Any]] | None:
    """With ``LYNX_DECODE_INT8_REFERENCE=1``: greedy outputs of every case from a real ``lynx-int8`` pair on
    the normal loop (stopped before the ``lynx`` pair starts); otherwise None."""
    if os.environ.get("LYNX_DECODE_INT8_REFERENCE") != "1":
        return None
    deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-int8-bf16-no-overlap", INT8_CONFIG,
                               extra=NO_OVERLAP_ARGS)
    try:
        return {name: _run(deployment, SPECS[name], lynx=False) for name in CASES}
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def normal_loop_pd(model_path: str, deployment_logs: Path,
                   int8_reference: dict[str, dict[str, Any]] | None) -> Iterator[Any]:
    deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-bf16-no-overlap", LYNX_CONFIG,
                               {"SGLANG_LYNX_TEST_HOOKS": "1"}, extra=NO_OVERLAP_ARGS)
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def reference(normal_loop_pd: Any, int8_reference: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``lynx-int8`` decoding of every case on this loop (module docstring: which deployment gives it)."""
    return int8_reference if int8_reference is not None else verified_before_drafts(normal_loop_pd, CASES)


@pytest.fixture(scope="module")
def idle_state(normal_loop_pd: Any) -> dict[str, Any]:
    _run(normal_loop_pd, {"prompt": "Hello", "max_new_tokens": 2}, lynx=True)
    return settled_state(normal_loop_pd.decode_url)


@pytest.mark.parametrize("name", CASES)
def test_normal_loop_output_equals_lynx_int8(normal_loop_pd: Any, reference: dict[str, dict[str, Any]],
                                             idle_state: dict[str, Any], name: str) -> None:
    got = _run(normal_loop_pd, SPECS[name], lynx=True)
    ref = reference[name]
    meta = got["meta_info"]
    drafts, accepted = last(meta, "lynx_drafts"), last(meta, "lynx_accepted")
    print(f"\nno-overlap {name}: {drafts} drafts, {accepted} accepted, equal {got['output_ids'] == ref['output_ids']}")
    assert got["output_ids"] == ref["output_ids"]
    assert meta["finish_reason"] == ref["meta_info"]["finish_reason"]
    if name in ("timing0", "timing8"):
        assert drafts == SPECS[name]["hold"], meta
    else:
        assert drafts >= 1, meta
    assert 0 <= accepted <= drafts


def test_normal_loop_back_to_idle(normal_loop_pd: Any, idle_state: dict[str, Any]) -> None:
    _run(normal_loop_pd, {"prompt": "Hello", "max_new_tokens": 2}, lynx=True)
    after = settled_state(normal_loop_pd.decode_url)
    assert idle_problems(after, idle_state) == [], (after, idle_state)
