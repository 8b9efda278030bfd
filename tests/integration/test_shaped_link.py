"""Whole PD deployments on a real shaped link (netns + veth + tc tbf): the prefill runs in a network
namespace, the decode on the host; every prefill->decode byte crosses the shaped veth, which the tc
byte counters show; the namespace, the veth and the qdiscs are gone afterwards, also when the
launcher is stopped with Ctrl-C, fails to start, or is killed (the next launcher cleans up)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS
from sglang_lynx.launch.client import generate, needle_prompt
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.links import place_on_link
from sglang_lynx.transfer.link import LinkKind, cleanup_stale_links, open_netns_link

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root; this run is not root"),
]

GBPS = 0.2  # 25 MB/s: a ~1.4K-token prompt's bf16 KV (~32 MB) takes ~1.3 s to cross


def _kv_bytes_per_token(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * 2  # K and V, bf16


def _leftovers(pid: int) -> list[str]:
    """The namespaces and veths named after launcher ``pid`` that still exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    devs = re.findall(r"^\d+: (lx\d+[hn]\d+)", links, flags=re.M)
    return [n for n in names if n.startswith(f"lynx{pid}x")] + [d for d in devs if d.startswith(f"lx{pid}")]


def _long_prompt(model_path: str) -> str:
    from transformers import AutoTokenizer

    messages, _ = needle_prompt(1024)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _restore_sigint() -> None:
    """The launcher as started from a terminal: SIGINT at its default. A shell without job control starts
    background commands with SIGINT ignored, and Python keeps an inherited SIG_IGN, so a suite run as
    ``bash scripts/test.sh &`` would otherwise start a launcher that no Ctrl-C can stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _launcher(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "sglang_lynx.launch", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_restore_sigint)


@pytest.mark.server
@pytest.mark.timeout(1800)
def test_stock_pd_on_a_shaped_link_sends_its_kv_across_the_veth(model_path, deployment_logs) -> None:
    """Stock SGLang PD (no --lynx, SGLang's own Mooncake transfer) on the shaped link: the answer
    comes back and the namespace->host counter grew by at least the prompt's bf16 KV bytes."""
    with open_netns_link(GBPS) as link:
        dep = PDDeployment(model_path, extra_args=list(TEST_SERVER_ARGS), log_dir=deployment_logs / "shaped-raw")
        place_on_link(dep, link)
        with dep:
            dep.start(timeout_s=START_TIMEOUT_S)
            assert dep.prefill_url.startswith(f"http://{link.peer_addr}:")
            assert dep.decode_url.startswith(f"http://{link.host_addr}:")
            before = link.sent_bytes()
            out = generate(dep.url, _long_prompt(model_path), max_new_tokens=8, timeout=600)
            after = link.sent_bytes()
        ns = link.netns
    prompt_tokens = int(out["meta_info"]["prompt_tokens"])
    kv_bytes = prompt_tokens * _kv_bytes_per_token(model_path)
    to_decode = after[1] - before[1]
    assert out["text"] and prompt_tokens > 1000
    assert to_decode >= kv_bytes, f"{to_decode} bytes crossed towards the decode, the KV is {kv_bytes}"
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not _leftovers(os.getpid())


@pytest.mark.server
@pytest.mark.timeout(1800)
def test_launcher_lynx_on_a_shaped_link_then_ctrl_c_tears_everything_down(model_path, tmp_path) -> None:
    """``launch pd --link shaped -- --lynx --lynx-config lynx-int8``: the Lynx streams cross the veth
    (at least 8 bits per KV value: half the bf16 bytes), and SIGINT leaves no namespace or veth."""
    log = tmp_path / "launcher.log"
    proc = _launcher(["pd", "--link", "shaped", "--link-gbps", str(GBPS), "--log-dir", str(tmp_path / "logs"),
                      "--", *TEST_SERVER_ARGS, "--lynx", "--lynx-config", "lynx-int8"], log)
    try:
        deadline, url = time.monotonic() + START_TIMEOUT_S, None
        while url is None:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            found = re.search(r"endpoint: (http://\S+)", log.read_text())
            url = found.group(1) if found else None
            time.sleep(1.0)
        ns, dev = f"lynx{proc.pid}x0", f"lx{proc.pid}n0"

        def to_decode() -> int:
            out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev, "root"],
                                 capture_output=True, text=True, check=True).stdout
            return int(re.search(r"Sent (\d+) bytes", out).group(1))  # type: ignore[union-attr]

        before = to_decode()
        out = generate(url, _long_prompt(model_path), max_new_tokens=8, timeout=600)
        crossed = to_decode() - before
        kv_bytes = int(out["meta_info"]["prompt_tokens"]) * _kv_bytes_per_token(model_path)
        assert out["text"]
        assert crossed >= kv_bytes // 2, f"{crossed} bytes crossed, int8 of {kv_bytes} bf16 bytes is >= half"
        assert _leftovers(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=300)  # the launcher stops each server (15 s grace each) and the link
    assert not _leftovers(proc.pid), log.read_text()[-2000:]


@pytest.mark.server
@pytest.mark.timeout(600)
def test_a_launcher_that_fails_to_start_tears_the_link_down(tmp_path) -> None:
    log = tmp_path / "launcher.log"
    proc = _launcher(["pd", "--link", "shaped", "--link-gbps", "0.1", "--timeout", "300",
                      "--", "--no-such-sglang-flag"], log)
    assert proc.wait(timeout=500) == 1, log.read_text()
    assert "start-up failed" in log.read_text()
    assert "netns+veth+tc-tbf" in log.read_text()
    assert not _leftovers(proc.pid)


@pytest.mark.timeout(120)
def test_the_link_of_a_killed_launcher_is_cleaned_up_by_the_next_one() -> None:
    code = ("from sglang_lynx.transfer.link import open_netns_link\nimport time\n"
            "link = open_netns_link(0.1)\nprint(link.netns, flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ns = proc.stdout.readline().strip()
        assert ns == f"lynx{proc.pid}x0" and _leftovers(proc.pid)
    finally:
        proc.kill()  # SIGKILL: no atexit, no tear-down
        proc.wait(timeout=30)
    assert _leftovers(proc.pid)
    removed = cleanup_stale_links()
    assert f"netns {ns}" in removed and not _leftovers(proc.pid)
    with open_netns_link(0.1) as mine:  # a live launcher's link is left alone
        assert mine.kind is LinkKind.NETNS_TBF and f"netns {mine.netns}" not in cleanup_stale_links()
    assert not _leftovers(os.getpid())
