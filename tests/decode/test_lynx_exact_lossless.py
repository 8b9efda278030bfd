"""``lynx-exact`` is lossless to stock BF16 PD (issue 15): token-identical to ``raw`` once it drafts.

Real PD deployments of the default model in its own dtype (bf16), real Mooncake TCP on loopback, the
decode servers on SGLang's default (overlap) loop:

- ``raw``: stock SGLang PD, no ``--lynx`` (SGLang's own Mooncake transfer of the BF16 KV): the reference
  (``raw_pd``, shared with ``tests/foundation/test_pd_deployment.py``);
- ``lynx-exact`` with the test hooks: anchor, residual and the exact stream; each prompt's streams count
  as landed no earlier than after ``k`` drafts on the anchor-only KV (k cycled over :data:`HOLDS`), then
  the pool is restored to the prefill's BF16 KV bit for bit and one verify releases the agreeing prefix;
- the same deployment's recompute fallback (an exact stream that lands damaged, or streams that come late):
  still raw's output, on prompts neither prefill has seen.

One request at a time on each pair (plain decoding of B requests in one batch rounds by B); the
reference and the request under test go to their pairs side by side. Greedy, 40 new tokens,
``ignore_eos`` for the longer prompts. CI: 4 short prompts and 2 each of code, needle, continuation
(10); ``LYNX_EXACT_PER_KIND=10 LYNX_EXACT_SHORT=20`` gives the 50 of ``benchmark/decode/results``
(every case written to ``$LYNX_EXACT_RESULTS`` as JSON when that is set). The bit-for-bit KV restore
itself is tested without servers in ``tests/integration/test_transport_exact.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lossless_prompts import Prompt, lossless_prompts
from lynx_deployments import RESIDUAL_TIMEOUT_S, TRANSFER_TIMEOUT_S, start_lynx_pd

from pd_requests import last, pd_generate_side_by_side, settled_state

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(2400)]

EXACT_CONFIG = json.dumps(
    {"mode": "lynx-exact", "residual_timeout_s": RESIDUAL_TIMEOUT_S, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
)
HOLDS = (1, 4, 16, 64)
MAX_NEW = 40
PER_KIND = int(os.environ.get("LYNX_EXACT_PER_KIND", "2"))
SHORT = int(os.environ.get("LYNX_EXACT_SHORT", "4"))
ALL = lossless_prompts(PER_KIND)
PROMPTS = [p for p in ALL if p.kind == "short"][:SHORT] + [p for p in ALL if p.kind != "short"]


def _payload(prompt: Prompt, hold: int | None) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": prompt.kind != "short"}
    if hold is not None:
        sampling["custom_params"] = {"lynx_test_hold_residual_drafts": hold}
    return {"text": prompt.text, "sampling_params": sampling}


@pytest.fixture(scope="module")
def exact_pd(model_path: str, deployment_logs: Path) -> Iterator[Any]:
    deployment = start_lynx_pd(
        model_path, deployment_logs / "pd-lynx-exact-hooks", EXACT_CONFIG, {"SGLANG_LYNX_TEST_HOOKS": "1"}
    )
    try:
        yield deployment
    finally:
        deployment.stop()


def test_every_prompt_and_draft_count_equals_raw_pd(raw_pd: Any, exact_pd: Any) -> None:
    cases = []
    for i, prompt in enumerate(PROMPTS):
        hold = HOLDS[i % len(HOLDS)]
        want, got = pd_generate_side_by_side((raw_pd, _payload(prompt, None)), (exact_pd, _payload(prompt, hold)))
        meta = got["meta_info"]
        cases.append(
            {
                "name": prompt.name,
                "kind": prompt.kind,
                "hold": hold,
                "equal": got["output_ids"] == want["output_ids"],
                "drafts": last(meta, "lynx_drafts"),
                "accepted": last(meta, "lynx_accepted"),
                "phase": last(meta, "lynx_phase"),
                "fallback": last(meta, "lynx_fallback"),
                "prompt_tokens": want["meta_info"]["prompt_tokens"],
            }
        )
    drafts, accepted = sum(c["drafts"] or 0 for c in cases), sum(c["accepted"] or 0 for c in cases)
    print(
        f"\nbf16 lynx-exact vs raw PD, streams landed after k drafts (k in {HOLDS}): "
        f"{sum(c['equal'] for c in cases)}/{len(cases)} equal, {drafts} drafts, {accepted} accepted"
    )
    _record(cases)
    assert len(cases) >= 10
    assert [c for c in cases if not c["equal"]] == []
    assert all(c["phase"] == "normal" and c["fallback"] is None for c in cases), cases
    for c in cases:  # at least k drafts (more while the exact stream is still on its way; fewer only where
        # the 40-token window closed first)
        assert c["drafts"] >= min(c["hold"], MAX_NEW - 1) or c["kind"] == "short", c
    assert accepted > 0, cases


def _record(cases: list[dict[str, Any]]) -> None:
    path = os.environ.get("LYNX_EXACT_RESULTS")
    if not path:
        return
    from benchmark.provenance import provenance

    Path(path).write_text(json.dumps({
        "cases": cases, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "provenance": provenance(),
        "settings": {"holds": HOLDS, "max_new_tokens": MAX_NEW, "dtype": "bfloat16", "reference": "raw PD",
                     "decode_loop": "overlap (SGLang default)"}}, indent=1))


FALLBACK_CASES = {  # custom params -> what lynx_fallback must say
    "corrupt_exact": ({"lynx_test_prefill_fault": "corrupt_exact"}, "exact stream: checksum mismatch"),
    # the exact stream's size is the sender's (it depends on the values): its crc32 over the bytes announced
    # is what catches 64 bytes too many
    "wrong_size_exact": ({"lynx_test_prefill_fault": "wrong_size_exact"}, "exact stream: checksum mismatch"),
    "late": ({"lynx_test_ignore_residual": True}, "not landed"),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_the_recompute_fallback_still_equals_raw_pd(raw_pd: Any, exact_pd: Any, case: str) -> None:
    """The exact stream lands damaged (a byte flipped after its crc32 was taken, or announced 64 bytes too
    long), or the streams count as late (the decode ignores them: it drafts until ``residual_timeout_s``):
    the request is neither failed nor answered from the 8-bit KV; the recompute fallback rebuilds the prompt
    KV on the decode server as the prefill computed it and verifies the drafts as decode steps, so the output
    is raw PD's. A prompt neither prefill server has seen (its KV computed in one pass there, as the
    recompute computes it). The servers' idleness afterwards: the next test."""
    params, message = FALLBACK_CASES[case]
    base = next(p for p in PROMPTS if p.kind != "short")
    prompt = Prompt(f"{base.name}-{case}", base.kind, f"Fallback check {case}.\n{base.text}")
    payload = _payload(prompt, None)
    payload["sampling_params"]["custom_params"] = params
    want, got = pd_generate_side_by_side((raw_pd, _payload(prompt, None)), (exact_pd, payload))
    meta = got["meta_info"]
    fallback, drafts = str(last(meta, "lynx_fallback")), last(meta, "lynx_drafts")
    print(f"\n{case}: fallback {fallback!r}, {drafts} drafts, equal to raw: {got['output_ids'] == want['output_ids']}")
    assert fallback.startswith("recompute") and message in fallback, meta
    assert got["output_ids"] == want["output_ids"]
    if case == "late":
        assert drafts >= 1, meta  # the recompute verified drafts made on the anchor-only KV


def test_both_servers_are_idle_after_the_exact_requests(exact_pd: Any) -> None:
    from sglang_lynx.launch.server_state import lynx_state

    assert settled_state(exact_pd.decode_url)["staging"]["leases"] == 0
    deadline, state = time.monotonic() + 60.0, None
    while time.monotonic() < deadline:  # the prefill frees a send region once its last write is done
        state = lynx_state(exact_pd.prefill_url)
        staging = (state or {}).get("staging") or {}
        if staging.get("leases") == 0 and staging.get("free_bytes") == staging.get("arena_bytes"):
            return
        time.sleep(0.5)
    raise AssertionError(f"the prefill's send arena is not free 60 s after the last request: {state}")
