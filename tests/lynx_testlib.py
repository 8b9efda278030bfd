"""Helpers shared by the test tiers that start real deployments (imported by conftest and tests)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

START_TIMEOUT_S = float(os.environ.get("LYNX_TEST_START_TIMEOUT", "600"))
TEST_SERVER_ARGS = ["--max-total-tokens", "16384"]


@contextlib.contextmanager
def scoped_env(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set ``env`` in this process (servers started inside inherit it) and restore every key after."""
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: session fixture name -> its running deployment while it runs: stopped right after the last selected
#: test that uses it (``conftest.pytest_runtest_teardown``), at the session's end otherwise
STOPPED_AFTER_LAST_USER: dict[str, Any] = {"single_server": None, "lynx_pd": None, "raw_pd": None}
LAST_USER: dict[str, str] = {}  # fixture name -> node id of its last user (filled after collection)


def stop_after_last_user(nodeid: str) -> None:
    for name, last in LAST_USER.items():
        deployment = STOPPED_AFTER_LAST_USER.get(name)
        if last == nodeid and deployment is not None:
            STOPPED_AFTER_LAST_USER[name] = None
            deployment.stop()


def started(deployment: Any) -> Any:
    """``deployment`` started within ``START_TIMEOUT_S``; stopped (and the error raised) if it does not start."""
    try:
        deployment.start(timeout_s=START_TIMEOUT_S)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def shared(name: str, deployment: Any) -> Iterator[Any]:
    """Yield the started ``deployment`` as the session fixture ``name`` (one of
    :data:`STOPPED_AFTER_LAST_USER`); stop it at the end if its last user has not."""
    STOPPED_AFTER_LAST_USER[name] = deployment
    try:
        yield deployment
    finally:
        if STOPPED_AFTER_LAST_USER.get(name) is deployment:
            STOPPED_AFTER_LAST_USER[name] = None
        deployment.stop()  # idempotent


def start_pd(model_path: str, log_dir: Path, lynx_config: str | None = None,
             extra: list[str] | None = None) -> Iterator[object]:
    """Start a PD deployment (optionally with ``--lynx --lynx-config``), yield it, tear it down.

    Test servers get a small KV pool so that several deployments fit in memory at once."""
    from sglang_lynx.launch.deployment import PDDeployment

    args = [*TEST_SERVER_ARGS, *(extra or [])]
    if lynx_config is not None:
        args += ["--lynx", "--lynx-config", lynx_config]
    deployment = PDDeployment(model_path, extra_args=args, log_dir=log_dir)
    with deployment:
        deployment.start(timeout_s=START_TIMEOUT_S)
        yield deployment


#: lines that look like an error, matched case-insensitively: SGLang's own failures carry no level name
#: ("Decode transfer failed for request ...", "Error fetching prefill server info ...", an HTTP 500)
ERROR_MARKERS = ("error", "fail", "abort", "exception", " 500 ")
LOG_NOISE = ("invalid http request received", "ignore import error", "warnings.warn", "warning:",
             "fail to set rlimit_nofile", "deprecat", "server_args=")
ERROR_LINES_PER_FILE = 20
LYNX_LINES_PER_FILE = 8  # Lynx's own messages ("lynx: ..."), the last few, for context
TRACEBACK_LINES = 40


def deployment_log_excerpt(log_dir: Path) -> str:
    """What a failed test shows of a deployment's logs (CI keeps only the test output): per log file the
    last ``ERROR_LINES_PER_FILE`` lines that look like an error, the last ``LYNX_LINES_PER_FILE`` other Lynx
    messages, and its last traceback (whole)."""
    parts = []
    for log in sorted(Path(log_dir).glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        errors, lynx = [], []
        for line in lines:
            low = line.lower()
            if any(m in low for m in ERROR_MARKERS) and not any(n in low for n in LOG_NOISE):
                errors.append(line)
            elif "lynx: " in low:
                lynx.append(line)
        starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback")]
        if not errors and not lynx and not starts:
            continue
        parts.append(f"--- {log} ---")
        parts.extend(ln[:400] for ln in errors[-ERROR_LINES_PER_FILE:])
        if lynx:
            parts.append("(its last Lynx messages)")
            parts.extend(ln[:400] for ln in lynx[-LYNX_LINES_PER_FILE:])
        if starts:
            parts.append("(its last traceback)")
            parts.extend(ln[:400] for ln in lines[starts[-1]:starts[-1] + TRACEBACK_LINES])
    return "\n".join(parts)


def deployments_of(values: Mapping[str, Any]) -> list[Any]:
    """The deployments among a test's fixture values (a wrapper's ``deployment`` too): those with a log dir."""
    found = []
    for value in values.values():
        for candidate in (value, getattr(value, "deployment", None)):
            if isinstance(getattr(candidate, "log_dir", None), Path) and candidate not in found:
                found.append(candidate)
    return found
