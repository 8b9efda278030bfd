"""The link a launched PD deployment runs on: none (loopback), the application pacer, or a shaped link.

``open_deployment_link(choice, gbps, delay_ms)`` opens it (``choice``: ``none``, ``pacer``,
``shaped`` or ``auto`` = shaped when this host allows it, else the pacer); ``place_on_link(dep,
link)`` puts a :class:`PDDeployment` on it before ``start()``. The caller closes the link after the
deployment has stopped (``Link`` is a context manager; it also closes at interpreter exit, and
``transfer.link.cleanup_stale_links`` removes the namespaces of a launcher that was killed).

Shaped (``netns+veth+tc-tbf``): the prefill servers run in the link's namespace (``ip netns exec``),
bound to the namespace end of the veth; the decode servers run on the host, bound to the host end;
the router and the client stay on the host and reach both. Every prefill<->decode byte therefore
crosses the shaped veth: the Lynx streams (their Mooncake engine is given ``--host``), SGLang's own
Mooncake transfers and ZMQ control messages (SGLang advertises ``SGLANG_HOST_IP``, not ``--host``: set
to the side's address, and so is ``MC_TCP_BIND_ADDRESS``) and the bootstrap (the decode looks it up at
the prefill's URL host, which the router passes). Mooncake's listeners still bind 0.0.0.0 (seen with
``ss`` on this build); that does not matter here: the namespace has only ``lo`` and the veth, and
routes only the veth's /24, so every byte between a prefill and a decode crosses the veth.
``link.sent_bytes()`` counts what crossed, per direction.

Pacer (``application-pacer``): only the Lynx streams are paced (``SGLANG_LYNX_LINK_GBPS`` in the
environment the servers inherit); SGLang's own transfers (a deployment without ``--lynx``) cross
loopback at full speed.
"""

from __future__ import annotations

import os

from sglang_lynx.launch.deployment import PDDeployment, Placement
from sglang_lynx.transfer.link import Link, LinkKind, LinkSetupError, open_link, open_netns_link

LINK_CHOICES = ("none", "pacer", "shaped", "auto")


def open_deployment_link(choice: str, gbps: float | None, delay_ms: float = 0.0) -> Link:
    """Open the link ``choice`` names; raises :class:`LinkSetupError` (``shaped`` that cannot be
    made, a rate missing, a delay on the pacer) with the reason."""
    if choice not in LINK_CHOICES:
        raise LinkSetupError(f"--link {choice}: expected one of {', '.join(LINK_CHOICES)}")
    if choice == "none":
        if gbps is not None or delay_ms:
            raise LinkSetupError("--link none takes no --link-gbps / --link-delay-ms")
        return open_link(None)
    if gbps is None or gbps <= 0:
        raise LinkSetupError(f"--link {choice} needs --link-gbps R (> 0)")
    if choice == "shaped":
        link = open_netns_link(gbps, delay_ms)
    elif choice == "pacer":
        if delay_ms:
            raise LinkSetupError("--link pacer has no delay: use --link shaped for --link-delay-ms")
        link = open_link(gbps, prefer_netns=False)
        link.reason = "asked for"
    else:
        link = open_link(gbps, delay_ms=delay_ms)
        if link.kind is LinkKind.PACER and delay_ms:
            link.close()
            raise LinkSetupError(f"--link-delay-ms needs the shaped link, which is unavailable: {link.reason}")
    if link.kind is LinkKind.PACER:
        os.environ["SGLANG_LYNX_LINK_GBPS"] = str(gbps)
    return link


def place_on_link(dep: PDDeployment, link: Link) -> None:
    """Put ``dep``'s prefills behind ``link`` (a shaped link only; the pacer and none need nothing)."""
    if link.kind is not LinkKind.NETNS_TBF:
        return
    dep.prefill_place = Placement(link.peer_addr, link.exec_prefix, _bind_env(link.peer_addr))
    dep.decode_place = Placement(link.host_addr, [], _bind_env(link.host_addr))


def _bind_env(addr: str) -> dict[str, str]:
    return {"SGLANG_HOST_IP": addr, "MC_TCP_BIND_ADDRESS": addr}


def link_banner(link: Link) -> str:
    """One line saying which emulation runs and what it covers."""
    if link.kind is LinkKind.NETNS_TBF:
        return (f"[lynx] link: {link.describe()}: prefill in namespace {link.netns} at {link.peer_addr}, "
                f"decode on the host at {link.host_addr}; all prefill->decode traffic is shaped")
    if link.kind is LinkKind.PACER:
        return (f"[lynx] link: {link.describe()}: paces the Lynx streams only; SGLang's own transfers "
                "(no --lynx) cross loopback unpaced")
    return "[lynx] link: none (loopback)"
