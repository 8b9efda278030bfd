"""Unit tier: the launcher's link choice, the placement of a PD deployment on a shaped link (the
argv and environment of each server, before anything starts) and the demo's per-mode flags."""

from __future__ import annotations

import os

import pytest

from sglang_lynx.launch.demo import flags_for, requested_mode
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.links import open_deployment_link, place_on_link
from sglang_lynx.transfer.link import Link, LinkKind, LinkSetupError, LinkState


def test_demo_flags_swap_the_lynx_mode_and_keep_every_other_flag() -> None:
    extra = ["--lynx", "--lynx-config", "lynx", "--disable-overlap-schedule", "--max-total-tokens", "8192"]
    assert requested_mode(extra) == "lynx"
    assert requested_mode(["--lynx", "--lynx-config=lynx-int8"]) == "lynx-int8"
    assert requested_mode(["--max-total-tokens", "8192"]) == "lynx"  # the demo is about Lynx
    assert flags_for(extra, "int8") == ["--lynx", "--lynx-config", "int8", "--disable-overlap-schedule",
                                        "--max-total-tokens", "8192"]
    assert flags_for(extra, "raw") == ["--disable-overlap-schedule", "--max-total-tokens", "8192"]
    assert flags_for(["--lynx-config=int4", "--lynx"], "raw") == []


def test_link_choice_errors_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LinkSetupError, match="--link shaped needs --link-gbps"):
        open_deployment_link("shaped", None)
    with pytest.raises(LinkSetupError, match="--link none takes no"):
        open_deployment_link("none", 1.0)
    with pytest.raises(LinkSetupError, match="--link pacer has no delay"):
        open_deployment_link("pacer", 1.0, delay_ms=5)
    monkeypatch.delenv("SGLANG_LYNX_LINK_GBPS", raising=False)
    link = open_deployment_link("pacer", 0.5)
    assert link.kind is LinkKind.PACER and os.environ["SGLANG_LYNX_LINK_GBPS"] == "0.5"
    assert open_deployment_link("none", None).kind is LinkKind.NONE


def test_a_shaped_link_puts_the_prefill_in_the_namespace_and_binds_both_engines(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[str] = []

    def fake_free_port(host: str) -> int:  # the addresses exist only on a real link
        probed.append(host)
        return 27000 + len(probed)

    monkeypatch.setattr("sglang_lynx.launch.deployment.free_port", fake_free_port)
    link = Link(0.1, LinkKind.NETNS_TBF, netns="lynx1x0", host_addr="10.213.240.1", peer_addr="10.213.240.2",
                state=LinkState.UP)
    dep = PDDeployment("/m", extra_args=["--lynx"], log_dir=tmp_path, prefills=2)
    place_on_link(dep, link)
    procs = dep.server_processes()
    prefills, decode = procs[:2], procs[2]
    for proc in prefills:
        assert proc.argv[:4] == ["ip", "netns", "exec", "lynx1x0"]
        assert proc.argv[proc.argv.index("--host") + 1] == "10.213.240.2"
        assert proc.env["SGLANG_HOST_IP"] == proc.env["MC_TCP_BIND_ADDRESS"] == "10.213.240.2"
    assert decode.argv[0] != "ip" and decode.argv[decode.argv.index("--host") + 1] == "10.213.240.1"
    assert decode.env["SGLANG_HOST_IP"] == decode.env["MC_TCP_BIND_ADDRESS"] == "10.213.240.1"
    assert probed == ["127.0.0.1"] * 4 + ["10.213.240.1"]  # namespace ports: free in a fresh namespace
    router = dep.router_argv()
    assert [router[i + 1] for i, a in enumerate(router) if a == "--prefill"] == dep.prefill_urls
    assert all(url.startswith("http://10.213.240.2:") for url in dep.prefill_urls)
    assert dep.decode_url.startswith("http://10.213.240.1:") and dep.url.startswith("http://127.0.0.1:")
    unshaped = PDDeployment("/m", log_dir=tmp_path)
    place_on_link(unshaped, Link(0.1, LinkKind.PACER, state=LinkState.UP))
    assert unshaped.prefill_place is None and unshaped.decode_place is None


def test_the_launcher_refuses_a_link_on_a_single_server(capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_lynx.launch.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["single", "--link", "shaped", "--link-gbps", "1"])
    assert exit_info.value.code == 2 and "not to single" in capsys.readouterr().err
