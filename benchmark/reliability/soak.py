"""Load soak of a PD deployment in mode ``lynx``: long-context load, faults, aborts, a peer restart.

One PD pair (prefill + decode + ``sglang_router``, fp32, SGLang's default overlap scheduler,
``SGLANG_LYNX_TEST_HOOKS=1``) runs a bounded mix (``--max-requests`` and ``--duration-s``, whichever
ends first) at ``--concurrency``:

- ``ordinary``: greedy, through the router; must equal the reference output of its prompt;
- ``sampled``: temperature 0.8, through the router; must complete (not checkable token for token);
- ``fault_residual`` / ``fault_anchor``: a transfer failed on purpose (``corrupt_*`` / ``wrong_size_*``
  through ``custom_params``, which the router drops: these go straight to the pair with bootstrap host,
  port and room, as the router would send them). A residual fault must give the exact recompute
  output, an anchor fault a clear error that names it;
- ``abort``: a streaming request through the router whose client disconnects after the first chunk, or
  a request aborted by SGLang's ``/abort_request``; it must not disturb the others.

More load than the arenas hold: ``--staging-mb`` (each side's Lynx arena: ``send_arena_mb`` / ``receive_arena_mb``) and
``--concurrency`` x the prompt lengths (``--min-tokens`` .. ``--max-tokens``); ``--lynx-config-json`` is
merged into ``CONFIG`` (keys the installed ``LynxConfig`` lacks, e.g. arena fields not merged yet, are left
out and listed in the report). A request refused for space counts as ``no_space``: a failure.
Peer restart (``--restart-prefill-at-s``, see ``restart.py``): the prefill is killed mid-load and started
again on the same ports; outcomes are counted per phase (before / in flight / after).

References (greedy, no fault) come from a pass at the start: per prompt the output of an ordinary request
and that of the recompute fallback (``lynx_test_ignore_residual``); a greedy answer is checked against the
reference of the path it reports (``meta_info.lynx_fallback``). Every request has a deadline
(``--request-timeout-s``); one with no answer by then is *lost* (rules in ``outcomes.py``).

Every ``--sample-every-s`` the RSS, open sockets and threads of each server's process group (prefill,
decode, router) are sampled; at the end both servers must answer ``/health_generate``, be back at idle
(staging, leases, tracked requests, registered bytes, decode KV pool; ``/get_server_info``) and be *flat*
(``sampling.py``: end within 2 % of the warm-up RSS, sockets and threads within +2). Results:
``--out-dir`` (default ``benchmark/reliability/results``) ``soak.{json,md}``; exit status 1 on any lost /
wrong / no-space answer, a failed restart, a failed idle check or a quantity that grew. The deployment
is torn down on every exit path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.provenance import machine, provenance, settings_dict  # noqa: E402
from benchmark.reliability.client import (  # noqa: E402
    health_generate,
    make_prompts,
    mem_available_gib,
    post,
    wait_idle,
)
from benchmark.reliability.options import parse_args  # noqa: E402
from benchmark.reliability.outcomes import (  # noqa: E402
    Result,
    classify,
    error_text,
    fallback_of,
    merge_config,
    plan,
    summarize,
    verdict,
)
from benchmark.reliability.report import markdown  # noqa: E402
from benchmark.reliability.restart import PrefillRestart  # noqa: E402
from benchmark.reliability.sampling import group_stats, resource_summary  # noqa: E402

from sglang_lynx.launch.server_state import lynx_state  # noqa: E402

SERVERS = ("prefill", "decode", "router")
CONFIG = {"mode": "lynx", "residual_timeout_s": 8.0, "transfer_timeout_s": 30.0}


@dataclass
class Soak:
    pair: Any
    prompts: list[str]
    args: argparse.Namespace
    refs: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    restart: PrefillRestart | None = None

    def _direct(self, text: str, sampling: dict[str, Any], timeout: float) -> tuple[int | None, Any, bool]:
        payload = {"text": text, "sampling_params": sampling, "bootstrap_host": self.pair.host,
                   "bootstrap_port": self.pair.bootstrap_port, "bootstrap_room": random.randint(0, 2**63 - 1)}
        prefill = threading.Thread(target=post, args=(f"{self.pair.prefill_url}/generate", payload, timeout),
                                   daemon=True)
        prefill.start()
        got = post(f"{self.pair.decode_url}/generate", payload, timeout)
        prefill.join(timeout=min(timeout, 60.0))
        return got

    def _greedy(self) -> dict[str, Any]:
        return {"max_new_tokens": self.args.max_new_tokens, "temperature": 0.0}

    def references(self) -> None:
        for i, text in enumerate(self.prompts):
            status, body, _ = post(f"{self.pair.url}/generate", {"text": text, "sampling_params": self._greedy()},
                                   self.args.request_timeout_s)
            if error_text(status, body) is not None:
                raise RuntimeError(f"reference request for prompt {i} failed: {status} {body}")
            status2, body2, _ = self._direct(text, {**self._greedy(),
                                                    "custom_params": {"lynx_test_ignore_residual": True}},
                                             self.args.request_timeout_s)
            if error_text(status2, body2) is not None or not fallback_of(body2).startswith("recompute"):
                raise RuntimeError(f"recompute reference for prompt {i} failed: {status2} {body2}")
            self.refs[i] = {"ordinary": body["output_ids"], "recompute": body2["output_ids"]}
            print(f"[soak] reference {i}: {body['meta_info'].get('prompt_tokens')} prompt tokens, "
                  f"ordinary == recompute: {body['output_ids'] == body2['output_ids']}", flush=True)

    def _stream_and_disconnect(self, text: str, after_s: float, timeout: float) -> tuple[int | None, Any, bool]:
        payload = {"text": text, "stream": True, "sampling_params": self._greedy()}
        req = urllib.request.Request(f"{self.pair.url}/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                for raw in resp:
                    if raw.startswith(b"data:") and time.monotonic() - started >= after_s:
                        break  # leaving the with-block closes the connection mid-stream
            return 200, {"disconnected_after_s": round(time.monotonic() - started, 2)}, False
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace"), False
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return None, repr(exc), "timed out" in str(exc)

    def _send(self, spec: dict[str, Any], text: str, timeout: float) -> tuple[int | None, Any, bool]:
        kind = spec["kind"]
        if kind in ("fault_residual", "fault_anchor"):
            return self._direct(text, {**self._greedy(), "custom_params": {"lynx_test_prefill_fault": spec["fault"]}},
                                timeout)
        if kind == "abort" and spec["abort_how"] == "disconnect":
            return self._stream_and_disconnect(text, spec["abort_after_s"], timeout)
        if kind == "abort":
            rid = uuid.uuid4().hex

            def _abort() -> None:
                time.sleep(spec["abort_after_s"])
                for url in (self.pair.decode_url, self.pair.prefill_url):
                    post(f"{url}/abort_request", {"rid": rid}, 30)

            aborter = threading.Thread(target=_abort, daemon=True)
            aborter.start()
            got = post(f"{self.pair.url}/generate", {"text": text, "rid": rid, "sampling_params": self._greedy()},
                       timeout)
            aborter.join(timeout=60)
            return got
        if kind == "sampled":
            return post(f"{self.pair.url}/generate", {"text": text, "sampling_params": {
                "max_new_tokens": self.args.max_new_tokens, "temperature": 0.8, "top_p": 0.95}}, timeout)
        return post(f"{self.pair.url}/generate", {"text": text, "sampling_params": self._greedy()}, timeout)

    def one(self, spec: dict[str, Any]) -> Result:
        started = time.monotonic()
        status, body, timed_out = self._send(spec, self.prompts[spec["prompt"]], self.args.request_timeout_s)
        ended = time.monotonic()
        result = Result(spec["kind"], spec["prompt"], round(ended - started, 3), status, body, spec.get("fault"),
                        spec.get("abort_how"), timed_out, started_s=round(started - self.t0, 2))
        if self.restart is not None:
            result.phase = self.restart.phase(started - self.t0, ended - self.t0)
        result.outcome, result.reason = classify(result, self.refs.get(spec["prompt"]))
        if isinstance(result.body, dict):  # keep the record small
            meta = result.body.get("meta_info") or {}
            result.body = {"output_ids_len": len(result.body.get("output_ids") or []),
                           "finish_reason": meta.get("finish_reason"), "lynx_fallback": fallback_of(result.body),
                           **{k: v for k, v in result.body.items() if k == "disconnected_after_s"}}
        return result

    def sample(self, label: str) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1), "label": label}
        restarting = self.restart is not None and not self.restart.gate.is_set()
        for proc in self.pair.processes:  # a prefill being restarted is not sampled: its segment starts ready
            if proc.name in SERVERS and proc.alive and not (restarting and proc.name == "prefill"):
                row[proc.name] = group_stats(proc.popen.pid)
        for name, url in (("prefill", self.pair.prefill_url), ("decode", self.pair.decode_url)):
            state = lynx_state(url, timeout=10.0)
            if state:
                row[f"{name}_staging_free"] = state["staging"]["free_bytes"]
                row[f"{name}_tracked"] = state.get("tracked_requests")
                if name == "decode":
                    row["decode_kv_pool_free"] = state.get("kv_pool_free_tokens")
        self.samples.append(row)
        return row

    def run(self, specs: list[dict[str, Any]], stop: threading.Event) -> tuple[list[Result], float]:
        results: list[Result] = []
        lock = threading.Lock()
        deadline = self.t0 + self.args.duration_s
        queue = list(specs)

        def worker() -> None:
            while not stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if not queue:
                        return
                    spec = queue.pop(0)
                if self.restart is not None and not self.restart.enter():
                    return
                if time.monotonic() >= deadline:  # the gate held it past the end
                    if self.restart is not None:
                        self.restart.leave()
                    return
                try:
                    res = self.one(spec)
                finally:
                    if self.restart is not None:
                        self.restart.leave()
                with lock:
                    results.append(res)
                    n = len(results)
                if res.outcome in ("wrong", "lost", "no_space") or n % 10 == 0:
                    print(f"[soak] {n} done ({time.monotonic() - self.t0:.0f} s): last {res.kind} {res.phase} "
                          f"{res.outcome} {res.seconds:.1f} s {res.reason[:120]}", flush=True)

        def sampler() -> None:
            while not stop.wait(self.args.sample_every_s):
                with contextlib.suppress(Exception):
                    self.sample("during")

        sampling = threading.Thread(target=sampler, daemon=True)
        sampling.start()
        if self.restart is not None:  # it lives until restart.release (the deployment is down)
            threading.Thread(target=self.restart.run, daemon=True).start()
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(self.args.concurrency)]
            for fut in futures:  # each worker stops taking work at the deadline; one request's bound after it
                fut.result(timeout=self.args.duration_s + self.args.request_timeout_s * 2 + 1200)
        stop.set()
        sampling.join(timeout=120)
        return results, time.monotonic() - self.t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmark.pd_modes import default_model_path

    from sglang_lynx.config import LynxConfig
    from sglang_lynx.launch.deployment import PDDeployment

    config, dropped = merge_config(CONFIG, args.lynx_config_json, {f.name for f in dataclasses.fields(LynxConfig)})
    if dropped:
        print(f"[soak] the installed LynxConfig has no field(s) {dropped}: left out of the config", flush=True)
    waited = time.monotonic()
    while mem_available_gib() < args.min_available_gib:
        if time.monotonic() - waited > 600:
            print(f"[soak] less than {args.min_available_gib} GiB available after 600 s: not starting")
            return 2
        time.sleep(10)
    model = args.model or default_model_path()
    os.environ["SGLANG_LYNX_TEST_HOOKS"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prov = provenance(sys.argv if argv is None else ["benchmark/reliability/soak.py", *argv])
    prompts = make_prompts(args.prompts, args.min_tokens, args.max_tokens)
    config = {"send_arena_mb": args.staging_mb, "receive_arena_mb": args.staging_mb, **config}
    specs = plan(args.max_requests, args.fault_fraction, args.abort_fraction, args.sampled_fraction,
                 args.prompts, args.seed)
    server_args = ["--max-total-tokens", args.max_total_tokens, "--dtype", "float32",
                   "--lynx", "--lynx-config", json.dumps(config)]
    if args.context_length:
        server_args += ["--context-length", str(args.context_length)]
    report: dict[str, Any] = {"settings": settings_dict(args), "config": config, "config_dropped": dropped,
                              "provenance": prov}
    router_args = [] if args.router_circuit_breaker else ["--disable-circuit-breaker"]
    pair = PDDeployment(model, extra_args=server_args, log_dir=args.log_dir, router_args=router_args)
    soak: Soak | None = None
    try:
        with pair:
            print("[soak] starting the pair", flush=True)
            report["start_s"] = round(pair.start(timeout_s=600), 1)
            report["log_dir"] = str(pair.log_dir)
            print(f"[soak] pair up in {report['start_s']} s (logs {pair.log_dir})", flush=True)
            soak = Soak(pair, prompts, args)
            soak.references()
            baseline = {"prefill": lynx_state(pair.prefill_url), "decode": lynx_state(pair.decode_url)}
            stop = threading.Event()
            soak.t0 = time.monotonic()
            if args.restart_prefill_at_s is not None:
                soak.restart = PrefillRestart(pair, args.restart_prefill_at_s, soak.t0, stop, args.restart_timeout_s)
            soak.sample("start")
            results, elapsed = soak.run(specs, stop)
            report["soak_s"] = round(elapsed, 1)
            memory: dict[str, Any] = {}
            for name, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url)):
                base = baseline[name] or {}
                if name == "prefill" and soak.restart is not None and soak.restart.ready_s is not None:
                    base = lynx_state(url) or {}  # a new process: its registration is its own
                problems, took = wait_idle(url, base, 120.0)
                memory[name] = {"idle_problems": problems, "idle_after_s": took,
                                "health_generate": health_generate(url)}
            soak.sample("end")
            report.update(memory=memory, baseline=baseline, samples=soak.samples,
                          restart=soak.restart.report() if soak.restart is not None else None,
                          resources=resource_summary(soak.samples, SERVERS, warmup_fraction=args.warmup_fraction,
                                                     rss_rel_tol=args.rss_tolerance, count_tol=args.count_tolerance),
                          summary=summarize(results), results=[asdict(r) for r in results])
    finally:
        if soak is not None and soak.restart is not None:
            soak.restart.release.set()
        prov["machine_end"] = machine()
    idle_ok = all(not m["idle_problems"] and m["health_generate"].startswith("ok") for m in report["memory"].values())
    restart_ok = soak is None or soak.restart is None or (soak.restart.ready_s is not None and not soak.restart.error)
    report["verdict"] = verdict(report["summary"], idle_ok, report["resources"]["all_flat"], restart_ok)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "soak.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report)
    (args.out_dir / "soak.md").write_text(md)
    print(md)
    return 0 if report["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
