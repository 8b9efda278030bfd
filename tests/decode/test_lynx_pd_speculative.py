"""Progressive speculative decoding (mode ``lynx``) in a real PD deployment: lossless against
``lynx-int8`` (same KV, no speculation) with the residual forced before, during and after the drafts,
finish inside the draft window, the late-residual fallback, speculative sampling (temperature > 0:
the verified tokens follow the full-KV law, a chi-square test, in bf16), the metrics page, and no
leaked KV.

The deployment is the session's bf16 ``lynx`` pair with the test hooks (``tests/decode/conftest.py``);
the many-prompt bf16 comparison with a real ``lynx-int8`` deployment is ``test_lynx_bf16_lossless.py``.
The no-speculation reference here is described in the ``reference`` fixture. Greedy comparisons run
one request at a time (a decode batch of B requests rounds its GEMMs by B in bf16).
"""

from __future__ import annotations

import math
import os
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from lynx_deployments import INT8_CONFIG, start_lynx_pd

from pd_requests import last, pd_generate, settled_state
from sglang_lynx.launch.client import haystack
from sglang_lynx.launch.server_state import idle_problems
from stats_testlib import chi_square, critical_value

pytestmark = [pytest.mark.server, pytest.mark.timeout(3000)]

CONCURRENCY = 3  # the sampling test only: greedy comparisons go one request at a time
LONG_PROMPT = "Write a long story about a lighthouse keeper and the storm that changed his life."
EOS_PROMPT = "Write one sentence about the sea:"


def _specs() -> dict[str, dict[str, Any]]:
    """Every greedy request of the module, by name: prompt, sampling params, test hold (Lynx only)."""
    specs: dict[str, dict[str, Any]] = {}
    for hold in (0, 8, 64):
        specs[f"timing{hold}"] = {"prompt": LONG_PROMPT, "max_new_tokens": 80, "hold": hold}
    specs["eos"] = {"prompt": EOS_PROMPT, "max_new_tokens": 60, "hold": 64}
    specs["max_tokens"] = {"prompt": LONG_PROMPT, "max_new_tokens": 10, "hold": 64}
    specs["stop_string"] = {"prompt": LONG_PROMPT, "max_new_tokens": 60, "hold": 64, "stop": [" the"]}
    specs["late_residual"] = {"prompt": LONG_PROMPT, "max_new_tokens": 30, "ignore_residual": True}
    return specs


SPECS = _specs()


def _run(deployment: Any, spec: dict[str, Any], lynx: bool) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    if "stop" in spec:
        sampling["stop"] = spec["stop"]
    if lynx:
        params: dict[str, Any] = {}
        if spec.get("hold") is not None:
            params["lynx_test_hold_residual_drafts"] = spec["hold"]
        if spec.get("ignore_residual"):
            params["lynx_test_ignore_residual"] = True
        if params:
            sampling["custom_params"] = params
    payload = {"text": spec["prompt"],
               "sampling_params": {"max_new_tokens": spec["max_new_tokens"], "temperature": 0.0, **sampling}}
    return pd_generate(deployment, payload)


@pytest.fixture(scope="module")
def idle_state(lynx_pd: Any) -> dict[str, Any]:
    """The decode server's settled state when this module starts (the leak check compares with it)."""
    _run(lynx_pd, {"prompt": "Hello", "max_new_tokens": 2}, lynx=True)
    return settled_state(lynx_pd.decode_url)


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, model_path: str, deployment_logs: Path) -> dict[str, dict[str, Any]]:
    """Greedy outputs of every spec without speculation on the lynx-int8 KV, one request at a time.

    With ``LYNX_DECODE_INT8_REFERENCE=1``: from a separate ``lynx-int8`` deployment (stopped before
    returning). Otherwise (default): from the Lynx deployment itself with the residual verified
    before any draft — the request then decodes normally on KV upgraded by
    ``decode_request_into(with_residual=True)``, the very function the ``lynx-int8`` receiver uses,
    i.e. exactly lynx-int8 decoding.
    """
    if os.environ.get("LYNX_DECODE_INT8_REFERENCE") == "1":
        deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-int8-spec", INT8_CONFIG)
        try:
            return {name: _run(deployment, spec, lynx=False) for name, spec in SPECS.items()}
        finally:
            deployment.stop()
    return verified_before_drafts(request.getfixturevalue("lynx_pd"), list(SPECS))


def verified_before_drafts(deployment: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Greedy outputs of the specs ``names`` on a ``lynx`` deployment with the residual verified before any
    draft (hold 0): ``lynx-int8`` decoding (``reference``'s docstring says why)."""
    out = {name: _run(deployment, {**SPECS[name], "hold": 0, "ignore_residual": False}, lynx=True)
           for name in names}  # fmt: skip
    for name, result in out.items():
        assert last(result["meta_info"], "lynx_drafts") == 0, (name, result["meta_info"])
    return out


@pytest.mark.parametrize("hold", [0, 8, 64])
def test_residual_before_midway_after_drafts(lynx_pd: Any, reference: dict[str, dict[str, Any]], hold: int) -> None:
    name = f"timing{hold}"
    got = _run(lynx_pd, SPECS[name], lynx=True)
    ref = reference[name]
    assert got["output_ids"] == ref["output_ids"]
    meta = got["meta_info"]
    drafts = last(meta, "lynx_drafts")
    # drafts follow the anchor-only KV, so where the draft window closes (cap, or a finish among
    # the drafts) is not the reference's business; hold 0 and 8 are exact (80 tokens are asked)
    if hold < 64:
        assert drafts == hold, meta
    else:
        assert 1 <= drafts <= 64, meta
    print(f"\nhold {hold}: {drafts} drafts, {last(meta, 'lynx_accepted')} accepted")
    assert 0 <= last(meta, "lynx_accepted") <= last(meta, "lynx_drafts")
    assert last(meta, "lynx_residual_landed_s") is not None and last(meta, "lynx_anchor_landed_s") is not None


@pytest.mark.parametrize("name", ["eos", "max_tokens", "stop_string"])
def test_finish_inside_draft_window(lynx_pd: Any, reference: dict[str, dict[str, Any]], name: str) -> None:
    got = _run(lynx_pd, SPECS[name], lynx=True)
    ref = reference[name]
    assert got["output_ids"] == ref["output_ids"]
    assert got["text"] == ref["text"]
    assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    assert last(got["meta_info"], "lynx_drafts") >= 1


def test_late_residual_takes_the_recompute_fallback(lynx_pd: Any, reference: dict[str, dict[str, Any]]) -> None:
    got = _run(lynx_pd, SPECS["late_residual"], lynx=True)
    meta = got["meta_info"]
    assert str(last(meta, "lynx_fallback")).startswith("recompute"), meta
    assert len(got["output_ids"]) == SPECS["late_residual"]["max_new_tokens"]
    # recompute rebuilds the prompt KV from token ids (no quantization): it equals lynx-int8 output
    # only where the int8 reconstruction does not change the greedy path; report, do not require
    same = got["output_ids"] == reference["late_residual"]["output_ids"]
    print(f"\nrecompute fallback output equal to lynx-int8: {same}")


# ----- speculative sampling (temperature > 0) -----
# ~390 tokens: longer than the codec's full-precision trailer (recent_tokens), so the drafts run on a
# truly quantized prefix and are sometimes rejected (a prompt inside the trailer drafts on exact KV)
SAMPLE_PROMPT = " ".join(haystack(300, seed=5)) + "\n\nOnce upon a time, in a small village,"
SAMPLE_PARAMS = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3}
SAMPLE_REQUESTS = 120
SAMPLE_HOLD = 2  # the residual counts as landed after 2 drafts: position 1 is always a verified draft


def _target_law_at_position_1(deployment: Any, first_token: int) -> dict[int, float]:
    """Law of output position 1 given ``first_token`` on the full (lynx-int8) KV, from the server:
    a request with logprobs never drafts (decode_sampling.speculation_blocker), so it decodes on
    the upgraded KV; top-3 logprobs at temperature 1, renormalised = the top_k=3 sampling law."""
    for _ in range(20):  # bounded: the first token is itself sampled
        payload = {"text": SAMPLE_PROMPT, "sampling_params": dict(SAMPLE_PARAMS),
                   "return_logprob": True, "top_logprobs_num": 3}
        got = pd_generate(deployment, payload)
        assert last(got["meta_info"], "lynx_drafts") == 0, got["meta_info"]  # never drafted
        if got["output_ids"][0] == first_token:
            entries = got["meta_info"]["output_top_logprobs"][1]
            weights = {int(e[1]): math.exp(float(e[0])) for e in entries}
            total = sum(weights.values())
            return {token: w / total for token, w in weights.items()}
    raise AssertionError(f"20 reference requests never started with token {first_token}")


def test_sampling_verified_tokens_follow_the_target_law(lynx_pd: Any) -> None:
    """Speculative sampling in the real server: the verified token at position 1 (always a draft
    sampled on the anchor-only KV, then accepted or resampled) follows the full-KV law. Pearson
    chi-square at false-alarm rate FALSE_ALARM (the server's own sampling randomness is not seeded,
    so a correct implementation fails this test with that probability)."""
    payload = {"text": SAMPLE_PROMPT, "sampling_params": {
        **SAMPLE_PARAMS, "custom_params": {"lynx_test_hold_residual_drafts": SAMPLE_HOLD}}}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda _: pd_generate(lynx_pd, payload), range(SAMPLE_REQUESTS)))
    drafts = [last(r["meta_info"], "lynx_drafts") for r in results]
    accepted = [last(r["meta_info"], "lynx_accepted") for r in results]
    assert all(d == SAMPLE_HOLD for d in drafts), drafts
    assert all(last(r["meta_info"], "lynx_phase") == "normal" for r in results)
    first = Counter(r["output_ids"][0] for r in results)
    modal, _ = first.most_common(1)[0]
    seconds = [r["output_ids"][1] for r in results if r["output_ids"][0] == modal]
    law = _target_law_at_position_1(lynx_pd, modal)
    tokens = sorted(law)
    counts = torch.tensor([seconds.count(t) for t in tokens] + [len([s for s in seconds if s not in law])])
    expected = torch.tensor([law[t] for t in tokens] + [0.0])
    stat, dof = chi_square(counts, expected)
    print(f"\nsampling: {len(seconds)}/{SAMPLE_REQUESTS} with the modal first token; position-1 counts "
          f"{counts.tolist()} vs law {[round(law[t], 3) for t in tokens]}; chi2 {stat:.2f} (dof {dof}, "
          f"critical {critical_value(dof):.2f}); drafts {sum(drafts)}, accepted {sum(accepted)} "
          f"({sum(a < d for a, d in zip(accepted, drafts, strict=True))} requests with a rejection)")
    assert len(seconds) >= SAMPLE_REQUESTS // 2
    assert 0 < sum(accepted) <= sum(drafts)
    assert stat < critical_value(dof), (counts.tolist(), law)


def test_metrics_page_shows_the_lynx_counters(lynx_pd: Any) -> None:
    """The aggregates on SGLang's Prometheus page (``--enable-metrics``) of the decode server."""
    with urllib.request.urlopen(f"{lynx_pd.decode_url}/metrics", timeout=30) as response:
        page = response.read().decode()
    values = {}
    for line in page.splitlines():
        if line.startswith("sglang_lynx_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    print(f"\nlynx counters on /metrics: {values}")
    for name in ("requests", "drafts", "accepted", "verifies"):
        assert values.get(f"sglang_lynx_{name}_total", 0.0) > 0, (name, values)
    assert values["sglang_lynx_accepted_total"] <= values["sglang_lynx_drafts_total"]


def _faulted(deployment: Any, spec: dict[str, Any], fault: str | None) -> tuple[int, Any]:
    """(HTTP status, the answer or the error text) of ``spec`` asking for a decode-side test fault."""
    payload = {"text": spec["prompt"], "sampling_params": {
        "max_new_tokens": spec["max_new_tokens"], "temperature": 0.0,
        "custom_params": {"lynx_test_hold_residual_drafts": spec["hold"],
                          **({"lynx_test_decode_fault": fault} if fault else {})}}}
    try:
        return 200, pd_generate(deployment, payload)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_a_request_raising_in_upgrade_or_verify_fails_alone(lynx_pd: Any, reference: dict[str, dict[str, Any]]) -> None:
    """Per-request isolation in the real server: beside an ordinary drafting request, one request whose
    KV upgrade raises and one whose verify raises (test faults, ``integration/decode/faults.py``) each
    get a 500 naming the failure; the ordinary one completes (its bf16 tokens depend on the batch it
    shared, so it is checked for completeness, not against the one-at-a-time reference); afterwards the
    server answers the reference exactly and the leak check (next test) finds it idle."""
    spec = {**SPECS["timing8"], "hold": 8}
    asks = {"ordinary": None, "upgrade": "raise_in_upgrade", "verify": "raise_in_verify"}
    with ThreadPoolExecutor(len(asks)) as pool:
        got = dict(zip(asks, pool.map(lambda f: _faulted(lynx_pd, spec, f), asks.values()), strict=True))
    status, answer = got["ordinary"]
    assert status == 200, answer
    assert len(answer["output_ids"]) == spec["max_new_tokens"], answer["meta_info"]
    assert last(answer["meta_info"], "lynx_drafts") == 8 and last(answer["meta_info"], "lynx_phase") == "normal"
    for name, fault in (("upgrade", "raise_in_upgrade"), ("verify", "raise_in_verify")):
        status, text = got[name]
        assert status == 500, (name, status, text)
        assert "sglang-lynx: internal error during" in text and f"test fault {fault}" in text, text
    again = _run(lynx_pd, SPECS["timing8"], lynx=True)
    assert again["output_ids"] == reference["timing8"]["output_ids"]
    print(f"\nisolation: ordinary request {last(answer['meta_info'], 'lynx_drafts')} drafts, "
          f"{last(answer['meta_info'], 'lynx_accepted')} accepted; the two faulted ones: HTTP 500")


def test_no_kv_leak_after_everything(lynx_pd: Any, idle_state: dict[str, Any]) -> None:
    _run(lynx_pd, {"prompt": "Hello", "max_new_tokens": 2}, lynx=True)
    after = settled_state(lynx_pd.decode_url)
    assert idle_problems(after, idle_state) == [], (after, idle_state)
