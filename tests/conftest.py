"""Shared fixtures: the prepared default model and real deployments shared across the session.

Every deployment is started at most once per test session (session-scoped), bounded in time
(``LYNX_TEST_START_TIMEOUT``, default 600 s) and torn down at the end, also on failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS


@pytest.fixture(scope="session", autouse=True)
def built_cpu_fast_path() -> None:
    """The C fast path as the set-up builds it (``scripts/test.sh`` runs the set-up; a bare ``pytest``
    builds it here once, so the kernel tests and the servers find it)."""
    from sglang_lynx.kernels import lynx_cpu_fast, lynx_exact_cpu

    with contextlib.suppress(RuntimeError):  # no compiler: the fast-path tests fail; servers use the reference
        lynx_cpu_fast.build()
        lynx_exact_cpu.build()


@pytest.fixture(scope="session")
def model_path() -> str:
    """The prepared default model (prepared on first use; idempotent)."""
    from sglang_lynx.models.prepare import prepare

    return str(prepare("smollm2-135m"))


@pytest.fixture(scope="session")
def deployment_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deployment-logs")


@pytest.fixture(scope="session")
def single_server(model_path: str, deployment_logs: Path) -> Iterator[object]:
    """One plain SGLang server on the default model."""
    from sglang_lynx.launch.deployment import SingleServer

    server = SingleServer(model_path, extra_args=list(TEST_SERVER_ARGS), log_dir=deployment_logs / "single")
    with server:
        server.start(timeout_s=START_TIMEOUT_S)
        yield server


