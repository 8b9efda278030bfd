"""The test suite's shared deployments (``lynx_testlib.shared``): stopped right after their last user."""

from __future__ import annotations

import lynx_testlib


class FakeDeployment:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


def test_a_shared_deployment_stops_after_its_last_user_and_once_more_at_the_end(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(lynx_testlib, "STOPPED_AFTER_LAST_USER", {"raw_pd": None})
    monkeypatch.setattr(lynx_testlib, "LAST_USER", {"raw_pd": "tests/b.py::test_last"})
    dep = FakeDeployment()
    fixture = lynx_testlib.shared("raw_pd", dep)
    assert next(fixture) is dep and lynx_testlib.STOPPED_AFTER_LAST_USER["raw_pd"] is dep
    lynx_testlib.stop_after_last_user("tests/a.py::test_first")
    assert dep.stops == 0
    lynx_testlib.stop_after_last_user("tests/b.py::test_last")
    assert dep.stops == 1 and lynx_testlib.STOPPED_AFTER_LAST_USER["raw_pd"] is None
    lynx_testlib.stop_after_last_user("tests/b.py::test_last")  # nothing left to stop
    assert dep.stops == 1
    for _ in fixture:  # the session's end: stop is idempotent on a real deployment
        pass
    assert dep.stops == 2


def test_the_conftest_knows_every_shared_fixture() -> None:
    assert set(lynx_testlib.STOPPED_AFTER_LAST_USER) >= {"single_server", "lynx_pd", "raw_pd"}
