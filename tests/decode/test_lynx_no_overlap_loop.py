"""Mode ``lynx`` on SGLang's other decode loop (``--disable-overlap-schedule``), in a real PD deployment.

The other decode-side server tests (``test_lynx_pd_speculative.py``, ``test_lynx_bf16_lossless.py``)
run the decode server on SGLang's default overlap loop; this module keeps the normal loop
(``event_loop_normal_disagg_decode``) tested with the same greedy requests: the residual landing
before, during and after the drafts (test hold 0 / 8 / 64), EOS, max tokens and a stop string inside
the draft window, each token-identical to the no-speculation reference (the request verified before
any draft decodes on the KV that ``lynx-int8`` decodes on: see ``test_lynx_pd_speculative.reference``),
and the decode server back to idle after (KV pool, staging).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lynx_deployments import LYNX_CONFIG, NO_OVERLAP_ARGS, start_lynx_pd
from test_lynx_pd_speculative import SPECS, _run

from pd_requests import last, settled_state
from sglang_lynx.launch.server_state import idle_problems

pytestmark = [pytest.mark.server, pytest.mark.timeout(2400)]

CASES = ["timing0", "timing8", "timing64", "eos", "max_tokens", "stop_string"]


@pytest.fixture(scope="module")
def normal_loop_pd(model_path: str, deployment_logs: Path) -> Iterator[Any]:
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


@pytest.fixture(scope="module")
def reference(normal_loop_pd: Any, idle_state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {name: _run(normal_loop_pd, {**SPECS[name], "hold": 0}, lynx=True) for name in CASES}
    for name, result in out.items():
        assert last(result["meta_info"], "lynx_drafts") == 0, (name, result["meta_info"])
    return out


@pytest.mark.parametrize("name", CASES)
def test_normal_loop_output_equals_the_reference(normal_loop_pd: Any, reference: dict[str, dict[str, Any]],
                                                 name: str) -> None:
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
