"""Mode ``lynx`` on SGLang's other decode loop (``--disable-overlap-schedule``), in a real PD deployment.

The other decode-side server tests (``test_lynx_pd_speculative.py``, ``test_lynx_bf16_lossless.py``)
run the decode server on SGLang's default overlap loop; this module keeps the normal loop
(``event_loop_normal_disagg_decode``) tested with the same greedy requests: the residual landing
before, during and after the drafts (test hold 0 / 8 / 64), EOS, max tokens and a stop string inside
the draft window, each token-identical to a real ``lynx-int8`` deployment on the same loop (started,
queried one request at a time and stopped before the ``lynx`` pair starts: only one pair is up at a
time), and the ``lynx`` decode server back to idle after (KV pool, staging). So the transfer-only
modes' decode path is run on this loop too (``lynx-int8``; they install no decode-loop hook).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lynx_deployments import INT8_CONFIG, LYNX_CONFIG, NO_OVERLAP_ARGS, start_lynx_pd
from test_lynx_pd_speculative import SPECS, _run

from pd_requests import last, settled_state
from sglang_lynx.launch.server_state import idle_problems

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

CASES = ["timing0", "timing8", "timing64", "eos", "max_tokens", "stop_string"]


@pytest.fixture(scope="module")
def reference(model_path: str, deployment_logs: Path) -> dict[str, dict[str, Any]]:
    """Greedy ``lynx-int8`` outputs of every case on the normal loop (deployment stopped after)."""
    deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-int8-bf16-no-overlap", INT8_CONFIG,
                               extra=NO_OVERLAP_ARGS)
    try:
        return {name: _run(deployment, SPECS[name], lynx=False) for name in CASES}
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def normal_loop_pd(model_path: str, deployment_logs: Path, reference: dict[str, dict[str, Any]]) -> Iterator[Any]:
    deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-bf16-no-overlap", LYNX_CONFIG,
                               {"SGLANG_LYNX_TEST_HOOKS": "1"}, extra=NO_OVERLAP_ARGS)
    try:
        yield deployment
    finally:
        deployment.stop()


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
