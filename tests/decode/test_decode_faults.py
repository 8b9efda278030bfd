"""The decode test faults do what the fault matrix relies on, checked on the real control server.

``stop_control_thread`` must look like a crash (the thread dies, the transport reports it), not like
an orderly stop: the fault matrix's decode-kill row asserts ``/health`` names ``lynx-control``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from sglang_lynx.integration.decode import faults
from sglang_lynx.integration.decode.tracked import TEST_HOOKS_ENV
from sglang_lynx.transfer.control import ControlServer


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def _request(fault: str | None) -> SimpleNamespace:
    params = {} if fault is None else {faults.DECODE_FAULT_KEY: fault}
    return SimpleNamespace(rid="r0", sampling_params=SimpleNamespace(custom_params=params))


def test_stop_control_thread_kills_the_thread_and_the_server_reports_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    server = ControlServer("127.0.0.1", on_message=lambda msg: None)
    try:
        assert server.unhealthy_reason() is None
        faults.on_admission(_request("stop_control_thread"), SimpleNamespace(control=server))
        assert _wait_for(lambda: not server._thread.is_alive())
        reason = server.unhealthy_reason()
        assert reason is not None and "lynx-control" in reason and "ControlThreadKilled" in reason
    finally:
        server.close()
    assert server.unhealthy_reason() is not None  # a dead thread stays reported after close


def test_an_orderly_close_is_not_a_death() -> None:
    server = ControlServer("127.0.0.1", on_message=lambda msg: None)
    server.close()
    assert not server._thread.is_alive()
    assert server.unhealthy_reason() is None


def test_faults_are_inert_without_the_test_hooks_and_unknown_ones_are_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    assert faults.decode_fault_of(_request("stop_control_thread")) is None
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    assert faults.decode_fault_of(_request(None)) is None
    with pytest.raises(ValueError, match="not one of"):
        faults.decode_fault_of(_request("explode"))
    with pytest.raises(faults.LynxTestFault):
        faults.raise_if_asked(_request("raise_in_verify"), "verify")
    faults.raise_if_asked(_request("raise_in_verify"), "upgrade")  # another stage: nothing raised
