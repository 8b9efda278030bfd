"""Heterogeneous TP (prefill and decode started with different ``--tp-size``) fails each request with the
reason, on the prefill side (no server: SGLang's registration and transfer records are stand-ins).

Neither server can know the other's TP from its own flags; the prefill learns the decode's at
registration (``KVArgsRegisterInfo.dst_attn_tp_size``). SGLang then sends a request through
``send_kvcache_slice`` (heads resliced between TP widths) instead of ``send_kvcache``: the Lynx manager
turns that into a failure naming both sizes, which SGLang forwards to the decode side and the client.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

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
