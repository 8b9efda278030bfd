"""A prefill started without ``--lynx`` is found out in seconds, not at ``transfer_timeout_s`` (real transport:
both sides, real Mooncake and control channel on loopback, no SGLang).

A Lynx prefill sends ``accepted`` (``transfer.control``) for each chunk it takes, before SGLang hears the
chunk is done; a decode whose request SGLang reports done (``arm``) with neither that notice nor the anchor
for ``accept_grace_s`` fails it with the hint to start the prefill with ``--lynx``. The whole path with real
servers is the fault matrix's ``test_prefill_without_lynx_fails_with_a_clear_error``.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_transport_streamed import Pair
from transport_testlib import poll_until_final, wait_idle

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.decode_side import LynxDecodeSide, Verdict

pytestmark = pytest.mark.timeout(120)


def test_a_success_without_any_lynx_notice_fails_after_the_grace_with_the_hint() -> None:
    side = LynxDecodeSide(LynxConfig(mode="lynx", transfer_timeout_s=60.0), "127.0.0.1")
    try:
        side.attach_pool([torch.zeros(256, 2, 64)], [torch.zeros(256, 2, 64)], pool_tokens=256,
                         max_request_tokens=128)
        assert side.accept_grace_s == 10.0  # the default: well inside transfer_timeout_s
        side.accept_grace_s = 0.5
        assert side.expect(3, list(range(40))) is True
        assert side.poll(3, need_residual=False)[0] is Verdict.PENDING  # not armed: the prefill still computes
        side.arm(3)  # SGLang: the (plain) prefill wrote its raw KV and reported success
        started = time.monotonic()
        verdict, why = poll_until_final(side, 3, need_residual=False, bound_s=30)
        waited = time.monotonic() - started
        assert verdict is Verdict.FAILED and 0.4 < waited < 10, (verdict, waited)
        assert "no Lynx stream came from the prefill server" in why and "--lynx" in why, why
        assert 3 not in side.inbound
    finally:
        side.close()


def test_a_lynx_prefill_says_accepted_before_sglang_hears_the_request_is_done() -> None:
    pair = Pair(LynxConfig(mode="lynx", page_tokens=64), page_size=1)
    try:
        pair.decode.accept_grace_s = 0.0  # an armed request without the notice would fail at its first poll
        manager, src, dst = pair.start(21)
        for chunk in pair.chunks(len(dst)):
            assert pair.prefill.send_kvcache(manager, "s", src[chunk], dst[chunk]) == 0
        progress = pair.decode.inbound[21]
        deadline = time.monotonic() + 10
        while not progress.accepted and time.monotonic() < deadline:  # the notice went before send_kvcache returned
            time.sleep(0.01)
        assert progress.accepted, "no accepted notice from the Lynx prefill"
        pair.decode.arm(21)
        assert poll_until_final(pair.decode, 21, need_residual=False)[0] is Verdict.DONE
        assert poll_until_final(pair.decode, 21, need_residual=True)[0] is Verdict.DONE
        assert pair.failures == []
        wait_idle(pair.prefill, pair.decode)
    finally:
        pair.close()
