"""The prefill-side test faults are inert unless SGLANG_LYNX_TEST_HOOKS=1, and refuse unknown names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_lynx.integration.transport import faults as transport_faults
from sglang_lynx.transfer.streams import StreamDescriptor, StreamKind


def _req(fault: object) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params={transport_faults.FAULT_KEY: fault}))


def test_faults_are_inert_without_the_test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(transport_faults.TEST_HOOKS_ENV, raising=False)
    assert transport_faults.fault_of(_req("corrupt_anchor")) is None
    monkeypatch.setenv(transport_faults.TEST_HOOKS_ENV, "0")
    assert transport_faults.fault_of(_req("corrupt_anchor")) is None
    desc = StreamDescriptor("1", StreamKind.ANCHOR, 100, 100, 7)
    assert transport_faults.before_landed_notice(None, None, desc, None, 0) is desc
    transport_faults.on_encode_start(None, "1")  # no fault: returns (a stop would hang this test)
    transport_faults.after_landed_notice(None, desc)


def test_faults_read_per_request_and_unknown_names_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport_faults.TEST_HOOKS_ENV, "1")
    assert transport_faults.fault_of(_req("wrong_size_residual")) == "wrong_size_residual"
    assert transport_faults.fault_of(SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None))) is None
    with pytest.raises(ValueError, match="not one of"):
        transport_faults.fault_of(_req("explode"))


def test_wrong_size_fault_announces_more_bytes_only_for_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    anchor = StreamDescriptor("1", StreamKind.ANCHOR, 100, 100, 7)
    residual = StreamDescriptor("1", StreamKind.RESIDUAL, 300, 100, 9)
    got = transport_faults.before_landed_notice("wrong_size_residual", None, residual, None, 0)
    assert got.total_bytes == 300 + transport_faults.WRONG_SIZE_EXTRA and got.crc32 == 9
    assert transport_faults.before_landed_notice("wrong_size_residual", None, anchor, None, 0) is anchor


def test_the_exact_stream_faults_touch_the_exact_stream_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport_faults.TEST_HOOKS_ENV, "1")
    assert transport_faults.fault_of(_req("corrupt_exact")) == "corrupt_exact"
    residual = StreamDescriptor("1", StreamKind.RESIDUAL, 300, 100, 9)
    exact = StreamDescriptor("1", StreamKind.EXACT, 500, 100, 11)
    got = transport_faults.before_landed_notice("wrong_size_exact", None, exact, None, 0)
    assert got.total_bytes == 500 + transport_faults.WRONG_SIZE_EXTRA and got.crc32 == 11
    assert transport_faults.before_landed_notice("wrong_size_exact", None, residual, None, 0) is residual
    assert transport_faults.before_landed_notice("corrupt_exact", None, residual, None, 0) is residual
