"""The Lynx fault matrix in a real PD deployment (mode ``lynx``, real SGLang, real Mooncake on loopback).

One pair is started for the module (fp32, no overlap scheduler, ``SGLANG_LYNX_TEST_HOOKS=1`` on both
servers) plus, in one test, three short-lived extra servers with mismatched configurations. Faults
are injected per request through ``sampling_params.custom_params`` (requests go straight to both
servers, as the router would send them: the router drops ``custom_params``):

- prefill side (``integration/transport/faults.py``): a flipped byte in the landed anchor / residual,
  a landed notice announcing the wrong size, the prefill scheduler stopping itself (SIGSTOP) before the
  anchor or right after it (the test then keeps it stopped: a hung peer, or SIGKILLs it);
- decode side (``decode.scheduler``): ``lynx_test_ignore_residual`` keeps a request drafting (decode
  killed while drafting; the recompute reference).

For every row: what the client sees (a clear error, or the correct answer through the recompute
fallback), within a bound, and afterwards both servers' Lynx staging is idle, the decode KV pool is
back to its idle free count, registered memory is unchanged (``/get_server_info`` ``lynx`` block), and
the pair answers the next request correctly. Measured times are printed (``-s``) for BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lynx_testlib import START_TIMEOUT_S, TEST_SERVER_ARGS
from sglang_lynx.launch.client import haystack, post_json
from sglang_lynx.launch.deployment import PDDeployment, default_transfer_backend, server_argv
from sglang_lynx.launch.processes import ManagedProcess, free_port, http_ok, wait_healthy
from sglang_lynx.launch.server_state import idle_problems, lynx_state

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(3000)]

RESIDUAL_TIMEOUT_S = 8.0
TRANSFER_TIMEOUT_S = 30.0
# 64 MiB Lynx arenas (the auto size here would be ~51 MiB: the 4096-token pool's streams): the host is
# shared, a request here needs ~5 MB
CONFIG = {"mode": "lynx", "residual_timeout_s": RESIDUAL_TIMEOUT_S, "transfer_timeout_s": TRANSFER_TIMEOUT_S,
          "send_arena_mb": 64, "receive_arena_mb": 64}
# a small KV pool (the prompt is ~320 tokens): the 2-core host is shared and memory is tight
SERVER_ARGS = [*TEST_SERVER_ARGS, "--dtype", "float32", "--disable-overlap-schedule", "--max-total-tokens", "4096"]
LYNX_ARGS = ["--lynx", "--lynx-config", json.dumps(CONFIG)]
PROMPT = " ".join(haystack(240, seed=11)) + "\nQuestion: which log mentions the tides? Answer:"
MAX_NEW = 24
# SGLang's decode heartbeat: 5 s interval, 2 misses; the Lynx transfers of a lost prefill fail then
HEARTBEAT_BOUND_S = 25.0
IDLE_WAIT_S = TRANSFER_TIMEOUT_S + 60.0  # a failed region is held until the sender is quiet or this passes
CLIENT_TIMEOUT_S = 300.0
TIMES: dict[str, float] = {}


@dataclass
class Outcome:
    seconds: float
    status: int | None  # HTTP status, None when the connection failed
    body: Any

    @property
    def error(self) -> str | None:
        """The error the client saw (None: a normal answer)."""
        if self.status != 200:
            return json.dumps(self.body) if not isinstance(self.body, str) else self.body
        finish = (self.body.get("meta_info") or {}).get("finish_reason") or {}
        return json.dumps(finish) if finish.get("type") == "abort" else None

    @property
    def meta(self) -> dict[str, Any]:
        return self.body.get("meta_info", {}) if isinstance(self.body, dict) else {}


def _post(url: str, payload: dict[str, Any], timeout: float) -> Outcome:
    started = time.monotonic()
    try:
        body: Any = post_json(url, payload, timeout)
        status: int | None = 200
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode(errors="replace")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = raw
    except (urllib.error.URLError, OSError) as exc:
        status, body = None, repr(exc)
    return Outcome(time.monotonic() - started, status, body)


def _generate(pair: PDDeployment, *, fault: str | None = None, decode_fault: str | None = None,
              ignore_residual: bool = False,
              hold: int | None = 0, max_new: int = MAX_NEW, decode_url: str | None = None,
              prefill_url: str | None = None, bootstrap_port: int | None = None,
              timeout: float = CLIENT_TIMEOUT_S) -> Outcome:
    """One request straight to a prefill and a decode server (bootstrap info as the router adds it);
    returns the decode server's answer without waiting for the prefill's (which may hang on purpose)."""
    params: dict[str, Any] = {}
    if fault:
        params["lynx_test_prefill_fault"] = fault
    if decode_fault:
        params["lynx_test_decode_fault"] = decode_fault
    if ignore_residual:
        params["lynx_test_ignore_residual"] = True
    elif hold is not None:
        params["lynx_test_hold_residual_drafts"] = hold
    sampling: dict[str, Any] = {"max_new_tokens": max_new, "temperature": 0.0}
    if params:
        sampling["custom_params"] = params
    payload = {"text": PROMPT, "sampling_params": sampling, "bootstrap_host": pair.host,
               "bootstrap_port": bootstrap_port or pair.bootstrap_port,
               "bootstrap_room": random.randint(0, 2**63 - 1)}
    threading.Thread(target=_post, args=(f"{prefill_url or pair.prefill_url}/generate", payload, timeout),
                     daemon=True).start()
    return _post(f"{decode_url or pair.decode_url}/generate", payload, timeout)


def _assert_idle(url: str, baseline: dict[str, Any], what: str) -> float:
    """Wait (bounded) until the server's Lynx state is idle; return how long it took."""
    started = time.monotonic()
    problems: list[str] = []
    while time.monotonic() - started < IDLE_WAIT_S:
        problems = idle_problems(lynx_state(url), baseline)
        if not problems:
            return time.monotonic() - started
        time.sleep(1.0)
    raise AssertionError(f"{what} did not return to idle within {IDLE_WAIT_S:.0f} s: {problems}")


def _health_generate(url: str, timeout_s: float = 120.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if http_ok(f"{url}/health_generate", timeout=60):
            return time.monotonic() - started
        time.sleep(2)
    raise AssertionError(f"{url}/health_generate did not answer within {timeout_s:.0f} s")


def _group_stopped(pgid: int) -> bool:
    """Whether a process of the process group is stopped (state T)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "T" and int(fields[2]) == pgid:
            return True
    return False


def _wait_stopped(proc: ManagedProcess, timeout_s: float = 120.0) -> None:
    assert proc.popen is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _group_stopped(proc.popen.pid):
            return
        time.sleep(0.2)
    raise AssertionError(f"{proc.name} did not stop itself within {timeout_s:.0f} s")


def _proc(pair: PDDeployment, name: str) -> ManagedProcess:
    return next(p for p in pair.processes if p.name == name)


def _kill(proc: ManagedProcess) -> None:
    assert proc.popen is not None
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=60)


def _wait_for_memory(gib: float = 5.0, timeout_s: float = 300.0) -> None:
    """On a shared host, start another server only once there is room for it (bounded; then try anyway:
    SGLang refuses to start with a clear error when the memory is not there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meminfo = Path("/proc/meminfo").read_text().split("\n")
        available = next((int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")), 0)
        if available >= gib * (1 << 20):
            return
        time.sleep(5)


def _restart(proc: ManagedProcess) -> None:
    _wait_for_memory()
    proc.start()
    wait_healthy([proc], START_TIMEOUT_S)


def _record(name: str, seconds: float, outcome: Outcome | None = None) -> None:
    TIMES[name] = round(seconds, 2)
    seen = ""
    if outcome is not None:
        seen = (f" | HTTP {outcome.status}: {(outcome.error or '')[:300]}" if outcome.error else
                f" | answer, fallback {_last(outcome.meta, 'lynx_fallback')}")
    print(f"\n[fault-matrix] {name}: {seconds:.2f} s{seen}")


def _write_times() -> None:
    """Every ``[fault-matrix]`` time of this run to ``$LYNX_FAULT_MATRIX_RESULTS`` (JSON) when set, with
    the machine, commit and command, for ``benchmark/reliability/results`` (BENCHMARKS.md quotes it)."""
    path = os.environ.get("LYNX_FAULT_MATRIX_RESULTS")
    if not path:
        return
    from benchmark.provenance import provenance

    Path(path).write_text(json.dumps({"times_s": TIMES, "provenance": provenance(),
                                      "settings": {"server_args": [*SERVER_ARGS, *LYNX_ARGS]}}, indent=1))


@pytest.fixture(scope="module")
def pair(model_path: str, deployment_logs: Path) -> Iterator[PDDeployment]:
    os.environ["SGLANG_LYNX_TEST_HOOKS"] = "1"
    try:
        deployment = PDDeployment(model_path, extra_args=[*SERVER_ARGS, *LYNX_ARGS],
                                  log_dir=deployment_logs / "pd-lynx-fault-matrix")
        _wait_for_memory(6.0)
        with deployment:
            deployment.start(timeout_s=START_TIMEOUT_S)
            yield deployment
            print(f"\n[fault-matrix] times: {json.dumps(TIMES)}")
            _write_times()
    finally:
        os.environ.pop("SGLANG_LYNX_TEST_HOOKS", None)


@pytest.fixture(scope="module")
def idle(pair: PDDeployment) -> dict[str, dict[str, Any]]:
    """Both servers' Lynx state at rest (after one request each way)."""
    assert _generate(pair).error is None
    states = {"prefill": lynx_state(pair.prefill_url), "decode": lynx_state(pair.decode_url)}
    for name, state in states.items():
        assert state is not None and state["role"] == name, (name, state)
        assert state["registered_bytes"] >= state["staging"]["arena_bytes"] > 0, state
    return states  # type: ignore[return-value]


@pytest.fixture(scope="module")
def reference(pair: PDDeployment, idle: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Greedy outputs: ``verified`` (residual verified before any draft: lynx-int8 KV) and ``recompute``
    (the residual ignored: the recompute fallback rebuilds the prompt KV on the decode server)."""
    verified = _generate(pair)
    assert verified.error is None, verified.body
    assert _generate(pair).body["output_ids"] == verified.body["output_ids"], "greedy output is not repeatable"
    recompute = _generate(pair, ignore_residual=True)
    assert recompute.error is None, recompute.body
    assert str(recompute.meta.get("lynx_fallback", [""])[-1]).startswith("recompute"), recompute.meta
    return {"verified": verified.body["output_ids"], "recompute": recompute.body["output_ids"]}


def _rebootstrap(pair: PDDeployment, timeout_s: float = 120.0) -> None:
    """After a restart, send requests (bounded) until the pair answers again (the decode re-bootstraps)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _generate(pair, timeout=60).error is not None:
        time.sleep(2)


@pytest.fixture(autouse=True)
def _pair_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every server of the pair running, none stopped, both Lynx-idle. A test that
    failed half-way is cleaned up here (a dead or dirty server restarted), so one failure does not
    cascade into the tests after it; a passing test has already shown the pair idle."""
    yield
    if "pair" not in request.fixturenames or "idle" not in request.fixturenames:
        return
    pair: PDDeployment = request.getfixturevalue("pair")
    idle: dict[str, dict[str, Any]] = request.getfixturevalue("idle")
    restarted = []
    for proc in pair.processes:
        if proc.alive:
            assert proc.popen is not None
            os.killpg(proc.popen.pid, signal.SIGCONT)
        dirty = proc.name in idle and proc.alive and idle_problems(
            lynx_state(pair.prefill_url if proc.name == "prefill" else pair.decode_url), idle[proc.name])
        if not proc.alive or dirty:
            if proc.alive:
                _kill(proc)
            _restart(proc)
            restarted.append(proc.name)
    if restarted:
        print(f"\n[fault-matrix] restored {restarted} after the test")
        _rebootstrap(pair)


def _after_fault(pair: PDDeployment, idle: dict[str, dict[str, Any]], reference: dict[str, list[int]],
                 name: str) -> None:
    """Both servers back to idle, and the next request on the pair is correct."""
    _record(f"{name}: decode idle after", _assert_idle(pair.decode_url, idle["decode"], "decode"))
    _record(f"{name}: prefill idle after", _assert_idle(pair.prefill_url, idle["prefill"], "prefill"))
    nxt = _generate(pair)
    assert nxt.error is None and nxt.body["output_ids"] == reference["verified"], nxt.body


def _last(meta: dict[str, Any], key: str) -> Any:
    value = meta.get(key)
    return value[-1] if isinstance(value, list) and value else value


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) of the TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_the_lynx_listener_binds_the_configured_host(pair, idle) -> None:
    """The one listener sglang-lynx opens itself (the decode's control socket) is on ``--host`` only
    (Mooncake's and SGLang's own listeners are documented in the README's exposure table)."""
    endpoint = idle["decode"]["control_endpoint"]
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host == pair.host, endpoint
    assert pair.host == "127.0.0.1"
    assert _listeners(int(port)) == ["0100007F"], (endpoint, _listeners(int(port)))


@pytest.mark.parametrize(("fault", "message"), [("corrupt_anchor", "checksum mismatch"),
                                                ("wrong_size_anchor", "wrong size")])
def test_bad_anchor_fails_the_request_with_a_clear_error(pair, idle, reference, fault: str, message: str) -> None:
    got = _generate(pair, fault=fault)
    _record(f"{fault}: client error after", got.seconds, got)
    assert got.error is not None, f"a request whose anchor was {fault} returned tokens: {got.body}"
    assert message in got.error and "anchor" in got.error, got.error
    assert got.seconds < 60, got.seconds
    _after_fault(pair, idle, reference, fault)


@pytest.mark.parametrize(("fault", "message"), [("corrupt_residual", "checksum mismatch"),
                                                ("wrong_size_residual", "wrong size")])
def test_bad_residual_takes_the_recompute_fallback(pair, idle, reference, fault: str, message: str) -> None:
    got = _generate(pair, fault=fault, hold=None)
    _record(f"{fault}: client answer after", got.seconds, got)
    assert got.error is None, got.body
    fallback = str(_last(got.meta, "lynx_fallback"))
    assert fallback.startswith("recompute") and message in fallback, got.meta
    assert got.body["output_ids"] == reference["recompute"], (got.body["output_ids"], reference)
    _after_fault(pair, idle, reference, fault)


def _extra_server(pair: PDDeployment, name: str, mode: str, lynx: list[str]) -> ManagedProcess:
    """One more server beside the pair."""
    port = free_port(pair.host)
    argv = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", default_transfer_backend(),
            *SERVER_ARGS, *lynx]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(free_port(pair.host))]
    assert pair.log_dir is not None
    return ManagedProcess(name, server_argv(pair.model_path, pair.host, port, argv),
                          f"http://{pair.host}:{port}/health", pair.log_dir / f"{name}.log", {"OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def _started(proc: ManagedProcess) -> Iterator[str]:
    try:
        _wait_for_memory()
        proc.start()
        wait_healthy([proc], START_TIMEOUT_S)
        yield proc.health_url.rsplit("/", 1)[0]
    finally:
        proc.stop()


def test_mismatched_modes_fail_with_a_clear_error(pair, idle, reference) -> None:
    """Decode started with another --lynx-config: detected when it registers (prefill log) and every
    request fails with an error that says so; no token comes from misread KV."""
    other = json.dumps({**CONFIG, "mode": "lynx-int8"})
    with _started(_extra_server(pair, "decode-lynx-int8", "decode", ["--lynx", "--lynx-config", other])) as url:
        got = _generate(pair, decode_url=url, hold=None)
        # a Lynx refusal fails its request, not the decode session: SGLang's transfer worker blacklists a
        # session on any failed send, and the next request would then fail as "session failed" at once
        again = _generate(pair, decode_url=url, hold=None)
    _record("mismatched modes: client error after", got.seconds, got)
    assert got.error is not None, got.body
    assert "Lynx configuration mismatch" in got.error, got.error
    assert again.error is not None and "Lynx configuration mismatch" in again.error, again.body
    log = _proc(pair, "prefill").log_path.read_text(errors="replace")
    assert "Lynx configuration mismatch at bootstrap" in log
    _after_fault(pair, idle, reference, "mismatched modes")


def test_decode_without_lynx_fails_with_a_clear_error(pair, idle, reference) -> None:
    with _started(_extra_server(pair, "decode-plain", "decode", [])) as url:
        got = _generate(pair, decode_url=url, hold=None)
    _record("decode without --lynx: client error after", got.seconds, got)
    assert got.error is not None, got.body
    assert "no Lynx registration" in got.error, got.error
    assert "registered without Lynx" in _proc(pair, "prefill").log_path.read_text(errors="replace")
    _after_fault(pair, idle, reference, "decode without --lynx")


def test_prefill_without_lynx_fails_with_a_clear_error(pair, idle, reference) -> None:
    """A plain prefill writes raw KV into the pool; the Lynx decode never admits it (no anchor), and fails it
    ``accept_grace_s`` (10 s) after SGLang reports it done, since no ``accepted`` notice came (the transfer
    timeout, 30 s from then, is what it waited for before)."""
    proc = _extra_server(pair, "prefill-plain", "prefill", [])
    bootstrap = int(proc.argv[proc.argv.index("--disaggregation-bootstrap-port") + 1])
    with _started(proc) as url:
        got = _generate(pair, prefill_url=url, bootstrap_port=bootstrap, hold=None)
    _record("prefill without --lynx: client error after", got.seconds, got)
    assert got.error is not None, got.body
    assert "no Lynx stream came from the prefill" in got.error, got.error
    assert "sent no Lynx notice" in got.error, got.error
    assert got.seconds < TRANSFER_TIMEOUT_S  # the transfer deadline alone counts 30 s from SGLang's success
    _after_fault(pair, idle, reference, "prefill without --lynx")


def test_hung_prefill_during_the_residual_falls_back_then_recovers(pair, idle, reference) -> None:
    prefill = _proc(pair, "prefill")
    result: dict[str, Outcome] = {}
    client = threading.Thread(target=lambda: result.setdefault("got", _generate(pair, fault="stop_after_anchor",
                                                                               hold=None)))
    client.start()
    try:
        _wait_stopped(prefill)
        client.join(timeout=CLIENT_TIMEOUT_S)
        assert not client.is_alive(), "the request hung behind a stopped prefill"
        got = result["got"]
        _record("hung prefill (residual): client answer after", got.seconds, got)
        assert got.error is None, got.body
        assert str(_last(got.meta, "lynx_fallback")).startswith("recompute"), got.meta
        assert got.body["output_ids"] == reference["recompute"]
        assert got.seconds < RESIDUAL_TIMEOUT_S + 60
        _record("hung prefill: decode /health_generate after", _health_generate(pair.decode_url))
        _record("hung prefill: decode idle while prefill stopped",
                _assert_idle(pair.decode_url, idle["decode"], "decode"))
    finally:
        assert prefill.popen is not None
        os.killpg(prefill.popen.pid, signal.SIGCONT)
    _after_fault(pair, idle, reference, "hung prefill")


def _health_answer(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_decode_killed_while_drafting(pair, idle, reference) -> None:
    """The drafting request also stops the decode's control thread on admission (test fault): before
    the kill, the decode's /health must answer 503 with the reason (health gate) and its server info
    name it; the restart after the kill heals it."""
    decode = _proc(pair, "decode")
    assert _health_answer(pair.decode_url)[0] == 200
    result: dict[str, Outcome] = {}
    client = threading.Thread(target=lambda: result.setdefault("got", _generate(
        pair, ignore_residual=True, max_new=200, decode_fault="stop_control_thread")))
    client.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # drafting: the request is admitted and its residual ignored
        state = lynx_state(pair.decode_url)
        if state is not None and state["inbound_requests"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the request was never admitted on the decode server")
    time.sleep(1.0)
    state = lynx_state(pair.decode_url)
    assert state is not None and "lynx-control" in str(state.get("unhealthy_reason")), state
    deadline = time.monotonic() + 90  # the gate answers from a record refreshed in the background
    status, text = _health_answer(pair.decode_url)
    while status != 503 and time.monotonic() < deadline:
        time.sleep(1.0)
        status, text = _health_answer(pair.decode_url)
    assert status == 503 and "sglang-lynx: unhealthy:" in text and "lynx-control" in text, (status, text)
    killed = time.monotonic()
    _kill(decode)
    client.join(timeout=CLIENT_TIMEOUT_S)
    assert not client.is_alive()
    got = result["got"]
    _record("decode killed while drafting: client error after kill", time.monotonic() - killed, got)
    assert got.error is not None and got.status is None, got.body  # the connection went down
    _record("decode killed: prefill /health_generate after", _health_generate(pair.prefill_url))
    _record("decode killed: prefill idle after", _assert_idle(pair.prefill_url, idle["prefill"], "prefill"))
    started = time.monotonic()
    _restart(decode)
    _record("decode restart", time.monotonic() - started)
    assert _health_answer(pair.decode_url)[0] == 200
    _after_fault(pair, idle, reference, "decode killed")


def test_prefill_killed_during_the_anchor_and_router_losing_it(pair, idle, reference) -> None:
    prefill = _proc(pair, "prefill")
    result: dict[str, Outcome] = {}
    client = threading.Thread(target=lambda: result.setdefault("got", _generate(pair, fault="stop_before_anchor")))
    client.start()
    _wait_stopped(prefill)
    killed = time.monotonic()
    _kill(prefill)
    client.join(timeout=CLIENT_TIMEOUT_S)
    assert not client.is_alive(), "the request hung after its prefill server died"
    got = result["got"]
    _record("prefill killed (anchor): client error after kill", time.monotonic() - killed, got)
    assert got.error is not None, f"a request whose KV never arrived returned tokens: {got.body}"
    assert time.monotonic() - killed < HEARTBEAT_BOUND_S + 10, got.error
    assert "lost" in got.error.lower(), got.error  # the heartbeat's verdict, not the Lynx timeout
    routed = _post(f"{pair.url}/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, 120)
    _record("router without its prefill: client error after", routed.seconds, routed)
    assert routed.error is not None, routed.body
    _record("prefill killed: decode /health_generate after", _health_generate(pair.decode_url))
    _record("prefill killed (anchor): decode idle after", _assert_idle(pair.decode_url, idle["decode"], "decode"))
    started = time.monotonic()
    _restart(prefill)
    _record("prefill restart", time.monotonic() - started)
    _rebootstrap(pair)
    _after_fault(pair, idle, reference, "prefill killed (anchor)")


def test_prefill_killed_during_the_residual_falls_back(pair, idle, reference) -> None:
    prefill = _proc(pair, "prefill")
    result: dict[str, Outcome] = {}
    client = threading.Thread(target=lambda: result.setdefault("got", _generate(pair, fault="stop_after_anchor",
                                                                               hold=None)))
    client.start()
    _wait_stopped(prefill)
    killed = time.monotonic()
    _kill(prefill)
    client.join(timeout=CLIENT_TIMEOUT_S)
    assert not client.is_alive()
    got = result["got"]
    _record("prefill killed (residual): client answer after kill", time.monotonic() - killed, got)
    assert got.error is None, got.body
    assert str(_last(got.meta, "lynx_fallback")).startswith("recompute"), got.meta
    assert got.body["output_ids"] == reference["recompute"]
    _record("prefill killed (residual): decode idle after",
            _assert_idle(pair.decode_url, idle["decode"], "decode"))
    _health_generate(pair.decode_url)
