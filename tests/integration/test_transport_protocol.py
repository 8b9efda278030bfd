"""The Lynx Mooncake engine takes SGLang's protocol and devices (issue 17; ``transport/protocol.py``).

Unit tier: the selection for TCP (``mooncake_tcp`` / ``MC_FORCE_TCP=1`` / ``MOONCAKE_PROTOCOL=tcp``) and
RDMA (the default, with the devices ``--disaggregation-ib-device`` names for the server's GPU, parsed
by SGLang's own function: a list, a JSON mapping, a JSON file). Real tier (mooncake): the engine
initializes with the chosen TCP transport on loopback. RDMA cannot run here (no HCA).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_lynx.integration.transport.protocol import mooncake_transport
from sglang_lynx.transfer.mooncake_engine import TCP, MooncakeEngine, mooncake_available


def _args(backend: str = "mooncake", ib: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_transfer_backend=backend, disaggregation_ib_device=ib)


@pytest.mark.parametrize(("args", "env"), [
    (_args("mooncake_tcp"), {}),
    (_args("mooncake", "mlx5_0"), {"MC_FORCE_TCP": "1"}),
    (_args("mooncake", "mlx5_0"), {"MOONCAKE_PROTOCOL": "tcp"}),
], ids=["mooncake_tcp", "MC_FORCE_TCP", "MOONCAKE_PROTOCOL=tcp"])
def test_tcp_where_sglang_uses_tcp(args: SimpleNamespace, env: dict[str, str]) -> None:
    t = mooncake_transport(args, 0, env)
    assert (t.protocol, t.device_name) == ("tcp", "")


def test_rdma_on_the_devices_sglang_gives_this_gpu(tmp_path: Path) -> None:
    pytest.importorskip("sglang")
    assert (mooncake_transport(_args(), 0, {}).protocol, mooncake_transport(_args(), 0, {}).device_name) == ("rdma", "")
    shared = mooncake_transport(_args(ib="mlx5_0,mlx5_1"), 3, {})
    assert (shared.protocol, shared.device_name) == ("rdma", "mlx5_0,mlx5_1")
    mapping = json.dumps({"0": "mlx5_0", "1": "mlx5_1"})
    assert mooncake_transport(_args(ib=mapping), 1, {}).device_name == "mlx5_1"
    path = tmp_path / "ib.json"
    path.write_text(mapping)
    assert mooncake_transport(_args(ib=str(path)), 0, {}).device_name == "mlx5_0"
    assert mooncake_transport(_args(ib="mlx5_0"), 0, {"MOONCAKE_PROTOCOL": "efa"}).protocol == "efa"
    with pytest.raises(ValueError, match="No IB devices configured for GPU 2"):
        mooncake_transport(_args(ib=mapping), 2, {})
    assert "mlx5_1" in mooncake_transport(_args(ib=mapping), 1, {}).describe()


@pytest.mark.mooncake
@pytest.mark.skipif(not mooncake_available(), reason="mooncake.engine does not import here")
def test_the_engine_initializes_with_the_chosen_tcp_transport() -> None:
    transport = mooncake_transport(_args("mooncake_tcp"), 0, {})
    engine = MooncakeEngine.start("127.0.0.1", transport)
    try:
        assert engine.transport == transport and engine.session_id.startswith("127.0.0.1:")
    finally:
        engine.close()
    assert (TCP.protocol, TCP.device_name) == ("tcp", "")  # what a side built without a transport uses
