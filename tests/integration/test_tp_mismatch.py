"""Heterogeneous TP (prefill and decode started with different ``--tp-size``) fails each request with the
reason, on the prefill side: with stand-ins for SGLang's registration and transfer records, and once
with real servers (a TP-2 prefill and a TP-1 decode).

Neither server can know the other's TP from its own flags; the prefill learns the decode's at
registration (``KVArgsRegisterInfo.dst_attn_tp_size``). SGLang then sends a request through
``send_kvcache_slice`` (heads resliced between TP widths) instead of ``send_kvcache``: the Lynx manager
turns that into a failure naming both sizes, which SGLang forwards to the decode side and the client.
"""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS
from pd_requests import pd_generate
from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.transport.prefill_side import LynxPrefillSide, tp_mismatch_reason
from sglang_lynx.integration.transport.wire import TpRank, config_fingerprint


def _manager(decode_tp: int, failures: dict[int, str]) -> SimpleNamespace:
    info = SimpleNamespace(mooncake_session_id="decode-1", is_dummy=False, dst_kv_indices=np.arange(10, 20),
                           decode_prefix_len=0, lynx={"target": {}})
    registration = SimpleNamespace(dst_attn_tp_size=decode_tp, lynx={"fingerprint": "fp"})
    return SimpleNamespace(transfer_infos={7: {"decode-1": info}}, decode_kv_args_table={"decode-1": registration},
                           record_failure=lambda room, reason: failures.__setitem__(room, reason))


def _side(tp: TpRank) -> LynxPrefillSide:
    """A prefill side without its engine and threads (only what the checks read)."""
    side = object.__new__(LynxPrefillSide)
    side.tp, side.fingerprint = tp, "fp"
    return side


def test_the_reason_names_both_sizes() -> None:
    reason = tp_mismatch_reason(2, 1)
    assert "prefill --tp-size 2" in reason and "decode --tp-size 1" in reason and "same --tp-size" in reason


def test_a_decode_with_another_tp_size_fails_the_request_with_the_reason() -> None:
    failures: dict[int, str] = {}
    manager = _manager(decode_tp=1, failures=failures)
    side = _side(TpRank(0, 2))
    rc = side.refuse_tp_mismatch(manager, "decode-1", np.arange(10, 14), 1)
    assert rc == -1 and failures == {7: f"sglang-lynx: {tp_mismatch_reason(2, 1)}"}
    # the same check on the ordinary path (a registration that says another TP size)
    info = manager.transfer_infos[7]["decode-1"]
    assert LynxPrefillSide._check_peer(side, manager, {"fingerprint": "fp"}, info) == tp_mismatch_reason(2, 1)  # type: ignore[arg-type]


def test_equal_tp_sizes_pass_the_peer_check() -> None:
    manager = _manager(decode_tp=2, failures={})
    side = _side(TpRank(1, 2))
    info = manager.transfer_infos[7]["decode-1"]
    assert LynxPrefillSide._check_peer(side, manager, {"fingerprint": "fp"}, info) == ""  # type: ignore[arg-type]
    assert config_fingerprint(LynxConfig(mode="lynx"))  # the fingerprint check itself is tested elsewhere


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_real_tp2_prefill_and_tp1_decode_fail_each_request_with_the_reason(model_path: str,
                                                                             deployment_logs: Path) -> None:
    """Real servers: a TP-2 prefill and a TP-1 decode, mode lynx-int8. Each server starts (neither can
    know the other's TP); the prefill logs the mismatch when the decode registers, and the request fails
    with the reason in the client's error."""
    from sglang_lynx.launch.deployment import PDDeployment

    args = [*TEST_SERVER_ARGS, "--dtype", "float32", "--max-total-tokens", "4096", "--lynx", "--lynx-config",
            json.dumps({"mode": "lynx-int8", "transfer_timeout_s": 120.0})]
    log_dir = deployment_logs / "tp-mismatch"
    deployment = PDDeployment(model_path, extra_args=args, log_dir=log_dir, prefill_args=["--tp-size", "2"])
    with deployment:
        # the two servers only: the launcher's start() waits for a request through the router to succeed,
        # which no request can here
        deployment.processes = deployment.server_processes()
        deployment._launch(START_TIMEOUT_S, False)
        payload = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        with pytest.raises(urllib.error.HTTPError) as failed:
            pd_generate(deployment, payload, 600.0)
        body = failed.value.read().decode(errors="replace")
        assert "tensor parallel sizes differ: prefill --tp-size 2, decode --tp-size 1" in body, body
    log = (log_dir / "prefill.log").read_text(errors="replace")
    assert "tensor parallel sizes differ at bootstrap" in log
