"""Shared fixtures: the prepared default model and real deployments shared across modules.

Every deployment is started at most once per test session, bounded in time (``LYNX_TEST_START_TIMEOUT``,
default 600 s). A deployment several modules use is a session fixture listed in
:data:`STOPPED_AFTER_LAST_USER`: it is stopped right after the last selected test that uses it (each
running pair holds ~5 GB, and the later modules start their own), and at the session's end otherwise,
also on failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lynx_testlib import (
    LAST_USER,
    STOPPED_AFTER_LAST_USER,
    TEST_SERVER_ARGS,
    deployment_log_excerpt,
    deployments_of,
    shared,
    started,
    stop_after_last_user,
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used real deployments shows their logs' error lines (CI keeps only the output)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for deployment in deployments_of(getattr(item, "funcargs", {})):
        try:
            excerpt = deployment_log_excerpt(deployment.log_dir)
        except OSError as exc:
            excerpt = f"(its logs could not be read: {exc})"
        if excerpt:
            report.sections.append((f"deployment logs: {deployment.log_dir.name}", excerpt))


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


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # the selected tests, in run order
        for name in getattr(item, "fixturenames", ()):
            if name in STOPPED_AFTER_LAST_USER:
                LAST_USER[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # after the item's own fixtures (module-scoped ones built on the deployment included)
    stop_after_last_user(item.nodeid)


@pytest.fixture(scope="session")
def single_server(model_path: str, deployment_logs: Path) -> Iterator[object]:
    """One plain SGLang server on the default model."""
    from sglang_lynx.launch.deployment import SingleServer

    server = SingleServer(model_path, extra_args=list(TEST_SERVER_ARGS), log_dir=deployment_logs / "single")
    yield from shared("single_server", started(server))


@pytest.fixture(scope="session")
def raw_pd(model_path: str, deployment_logs: Path) -> Iterator[object]:
    """Stock SGLang PD, no Lynx: prefill + decode (Mooncake on loopback) + router, the model in its own
    dtype (bf16); the reference ``lynx-exact`` must equal, and the plain PD the foundation tests check."""
    from sglang_lynx.launch.deployment import PDDeployment

    deployment = PDDeployment(model_path, extra_args=list(TEST_SERVER_ARGS), log_dir=deployment_logs / "pd-raw")
    yield from shared("raw_pd", started(deployment))
