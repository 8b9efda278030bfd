"""The soak's pure parts: the request mix, what one answer counts as, and the counts.

Outcomes: ``correct`` (a greedy answer equal to the reference of the path it reports, a sampled answer
with tokens, a residual fault that fell back to the exact recompute), ``clear_error`` (an anchor fault
whose error names it; a request in flight when the prefill was killed that ended with an error),
``aborted``, ``no_space`` (an error saying a staging arena had no room: a clear error, but a *failure* of
the soak, since a request that does not fit must wait, issue 13), ``wrong``, ``lost`` (no answer by the
deadline, or the connection dropped). Phases: ``before`` the prefill restart, ``in_flight`` at the kill
(started before it, answered after), ``after`` it (started once the pair routed again); ``-`` without one.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

KINDS = ("ordinary", "sampled", "fault_residual", "fault_anchor", "abort")
OUTCOMES = ("correct", "clear_error", "aborted", "no_space", "wrong", "lost")
FAILURES = ("no_space", "wrong", "lost")
PHASES = ("-", "before", "in_flight", "after")
RESIDUAL_FAULTS = {"corrupt_residual": "checksum mismatch", "wrong_size_residual": "wrong size"}
ANCHOR_FAULTS = {"corrupt_anchor": "checksum mismatch", "wrong_size_anchor": "wrong size"}
#: Substrings of the errors a full staging arena gives (``StagingFullError``, the prefill's refusal).
SPACE_ERRORS = ("has no free region", "send arena full", "stayed full")


@dataclass
class Result:
    """What one request saw. ``status`` None: no HTTP answer (connection failed or deadline passed)."""

    kind: str
    prompt: int
    seconds: float
    status: int | None
    body: Any = None
    fault: str | None = None
    abort_how: str | None = None
    timed_out: bool = False
    outcome: str = ""
    reason: str = ""
    phase: str = "-"
    started_s: float = 0.0  # since the soak's start


def error_text(status: int | None, body: Any) -> str | None:
    """The error a client saw (None: a normal answer with tokens)."""
    if status != 200:
        return body if isinstance(body, str) else json.dumps(body)
    if not isinstance(body, dict):
        return f"unexpected body {body!r:.200}"
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    return json.dumps(finish) if isinstance(finish, dict) and finish.get("type") == "abort" else None


def _last(value: Any) -> Any:
    return value[-1] if isinstance(value, list) and value else value


def fallback_of(body: Any) -> str:
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    value = _last(meta.get("lynx_fallback"))
    return "" if value is None else str(value)


def classify(result: Result, refs: dict[str, list[int]] | None) -> tuple[str, str]:
    """(outcome, reason) of one request; ``refs``: ``{"ordinary": ids, "recompute": ids}`` of its prompt."""
    if result.timed_out or (result.status is None and result.kind != "abort"):
        return "lost", f"no answer: {str(result.body)[:200]}"
    err = error_text(result.status, result.body)
    if err is not None and any(s in err for s in SPACE_ERRORS):
        return "no_space", err[:200]
    if result.kind == "abort":
        if err is not None or result.abort_how == "disconnect":
            return "aborted", (err or "client disconnected")[:200]
        # the abort came too late: the request finished, so its answer must be right
        result = Result("ordinary", result.prompt, result.seconds, result.status, result.body)
    if result.phase == "in_flight" and err is not None and err.strip():
        return "clear_error", f"in flight at the prefill kill: {err[:180]}"
    if result.kind == "fault_anchor":
        need = ANCHOR_FAULTS.get(result.fault or "", "?")
        if err is None:
            return "wrong", "a request whose anchor failed returned tokens"
        if need in err and "anchor" in err:
            return "clear_error", err[:200]
        return "wrong", f"error does not name the fault ({need}): {err[:200]}"
    if err is not None:
        return "wrong", f"unexpected error: {err[:200]}"
    ids = result.body.get("output_ids")
    if not ids:
        return "wrong", "no output tokens"
    if result.kind == "sampled":
        return "correct", "completed"
    fallback = fallback_of(result.body)
    if result.kind == "fault_residual" and result.phase != "in_flight":
        need = RESIDUAL_FAULTS.get(result.fault or "", "?")
        if not (fallback.startswith("recompute") and need in fallback):
            return "wrong", f"no recompute fallback naming {need!r}: {fallback!r}"
    if refs is None:
        return "wrong", "no reference"
    path = "recompute" if fallback.startswith("recompute") else "ordinary"
    if ids != refs[path]:
        return "wrong", f"output differs from the {path} reference"
    return "correct", path


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _counts(rows: list[Result]) -> dict[str, int]:
    return {"requests": len(rows), **{o: sum(r.outcome == o for r in rows) for o in OUTCOMES}}


def summarize(results: list[Result]) -> dict[str, Any]:
    """Counts per kind and outcome, latency p50 / p95 per kind (answered requests), counts per restart phase,
    lost / wrong / no-space totals."""
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [r for r in results if r.kind == kind]
        if not mine:
            continue
        answered = [r.seconds for r in mine if r.outcome not in ("lost", "aborted")]
        p50, p95 = percentile(answered, 0.5), percentile(answered, 0.95)
        by_kind[kind] = {**_counts(mine), "p50_s": None if p50 is None else round(p50, 2),
                         "p95_s": None if p95 is None else round(p95, 2)}
    by_phase = {ph: _counts([r for r in results if r.phase == ph]) for ph in PHASES
                if any(r.phase == ph for r in results)}
    answered_all = [r.seconds for r in results if r.outcome not in ("lost", "aborted")]
    p50, p95 = percentile(answered_all, 0.5), percentile(answered_all, 0.95)
    return {"requests": len(results), "by_kind": by_kind, "by_phase": by_phase,
            **{o: sum(r.outcome == o for r in results) for o in FAILURES},
            "unclassified": sum(r.outcome not in OUTCOMES for r in results),
            "p50_s": None if p50 is None else round(p50, 2), "p95_s": None if p95 is None else round(p95, 2),
            "failure_examples": [f"{r.kind}/{r.fault or r.abort_how or '-'}/{r.phase}: {r.reason}"
                               for r in results if r.outcome in FAILURES][:10]}


def plan(n: int, fault_fraction: float, abort_fraction: float, sampled_fraction: float, prompts: int,
         seed: int) -> list[dict[str, Any]]:
    """The request mix, drawn once (seeded)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        spec: dict[str, Any] = {"prompt": rng.randrange(prompts)}
        if u < fault_fraction:
            fault = rng.choice([*RESIDUAL_FAULTS, *ANCHOR_FAULTS])
            spec.update(kind="fault_residual" if fault in RESIDUAL_FAULTS else "fault_anchor", fault=fault)
        elif u < fault_fraction + abort_fraction:
            spec.update(kind="abort", abort_how=rng.choice(["disconnect", "abort_request"]),
                        abort_after_s=round(rng.uniform(0.2, 2.0), 2))
        elif u < fault_fraction + abort_fraction + sampled_fraction:
            spec.update(kind="sampled")
        else:
            spec.update(kind="ordinary")
        out.append(spec)
    return out


def merge_config(base: dict[str, Any], override_json: str | None, known: set[str]) -> tuple[dict[str, Any], list[str]]:
    """``base`` updated with the JSON object ``override_json``; keys the installed ``LynxConfig`` does not
    know (``known``: its fields) are left out and returned (the servers would refuse them at start-up).
    Raises ValueError for JSON that is not an object."""
    override = json.loads(override_json) if override_json else {}
    if not isinstance(override, dict):
        raise ValueError(f"--lynx-config-json must be a JSON object, not {override_json!r}")
    merged = {**base, **override}
    dropped = sorted(k for k in merged if k not in known)
    return {k: v for k, v in merged.items() if k in known}, dropped


def verdict(summary: dict[str, Any], idle_ok: bool, resources_flat: bool, restart_ok: bool) -> str:
    clean = all(summary[o] == 0 for o in FAILURES) and summary["unclassified"] == 0
    return "pass" if clean and idle_ok and resources_flat and restart_ok else "FAIL"
