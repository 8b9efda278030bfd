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


def test_a_failed_tests_deployment_logs_show_their_errors_and_last_traceback(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "decode.log").write_text("\n".join([
        "[t] WARNING:  Invalid HTTP request received.", "[t] Prefill batch. #new-seq: 1",
        "[t] lynx: request 7: residual stream: checksum mismatch", "Traceback (most recent call last):",
        '  File "verify.py", line 3, in verify', "RuntimeError: boom", "[t] Decode batch. #running-req: 1",
        "[t] Fail to set RLIMIT_NOFILE: current limit exceeds maximum limit",
        "[t] Decode transfer failed for request rank=0 rid='ab' with exception KVTransferError(room=3)",
        '[t] INFO:     127.0.0.1:5 - "POST /generate HTTP/1.1" 500 Internal Server Error']))
    (tmp_path / "router.log").write_text("[t] INFO request ok\n")
    dep = FakeDeployment()
    dep.log_dir = tmp_path  # type: ignore[attr-defined]

    class Wrapper:
        deployment = dep

    assert lynx_testlib.deployments_of({"a": dep, "b": Wrapper(), "c": 3}) == [dep]
    excerpt = lynx_testlib.deployment_log_excerpt(tmp_path)
    assert "checksum mismatch" in excerpt and "RuntimeError: boom" in excerpt
    assert "Decode transfer failed" in excerpt and "500 Internal Server Error" in excerpt  # SGLang's own lines
    assert "RLIMIT_NOFILE" not in excerpt.split("(its last traceback)")[0]  # start-up noise
    assert "Invalid HTTP request" not in excerpt and "router.log" not in excerpt
    assert "Prefill batch" not in excerpt.split("(its last traceback)")[0]
    assert lynx_testlib.deployment_log_excerpt(tmp_path / "empty") == ""
