"""The Mooncake protocol and devices of a Lynx server's engine: the ones SGLang's own engine uses.

SGLang 0.5.23 (``distributed/device_communicators/mooncake_transfer_engine.py``) initializes its
Mooncake engine with protocol ``MOONCAKE_PROTOCOL`` (default ``rdma``) on the RDMA devices that
``--disaggregation-ib-device`` names for the server's GPU (a shared list, a ``{gpu: devices}`` JSON
mapping or a JSON file; none: Mooncake picks), and forces TCP when ``MC_FORCE_TCP=1`` (which
``--disaggregation-transfer-backend mooncake_tcp`` sets). :func:`mooncake_transport` mirrors that
for the Lynx engine, so the anchor and residual streams ride the link SGLang's KV transfer rides:
RDMA where SGLang uses RDMA, TCP otherwise. Called once per server, when its KV manager is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sglang_lynx.transfer.mooncake_engine import MooncakeTransport

SGLANG_DEFAULT_PROTOCOL = "rdma"  # SGLang's envs.MOONCAKE_PROTOCOL default


def mooncake_transport(server_args: Any, gpu_id: int | None,
                       environ: Mapping[str, str] | None = None) -> MooncakeTransport:
    """The transport SGLang's own Mooncake engine runs with on this server (module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("MC_FORCE_TCP") == "1":
        return MooncakeTransport("tcp", "", "MC_FORCE_TCP=1, as SGLang's engine (mooncake_tcp)")
    if getattr(server_args, "disaggregation_transfer_backend", None) == "mooncake_tcp":
        return MooncakeTransport("tcp", "", "--disaggregation-transfer-backend mooncake_tcp")
    protocol = env.get("MOONCAKE_PROTOCOL") or SGLANG_DEFAULT_PROTOCOL
    if protocol == "tcp":
        return MooncakeTransport("tcp", "", "MOONCAKE_PROTOCOL=tcp")
    ib_device = getattr(server_args, "disaggregation_ib_device", None)
    devices = ""
    if ib_device:
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

        devices = get_ib_devices_for_gpu(ib_device, int(gpu_id or 0)) or ""
    why = f"--disaggregation-ib-device for GPU {gpu_id or 0}" if devices else "Mooncake picks the RDMA devices"
    return MooncakeTransport(protocol, devices, f"as SGLang's engine: {protocol}, {why}")
