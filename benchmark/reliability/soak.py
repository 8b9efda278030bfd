"""Load soak of a PD deployment in mode ``lynx``: concurrent long-context requests, faults, aborts.

One PD pair (prefill + decode + ``sglang_router``, fp32, no overlap scheduler, ``SGLANG_LYNX_TEST_HOOKS=1``)
runs a bounded mix (``--max-requests`` and ``--duration-s``, whichever ends first) at ``--concurrency``:

- ``ordinary``: greedy, through the router; must equal the reference output of its prompt;
- ``sampled``: temperature 0.8, through the router; must complete (not checkable token for token);
- ``fault_residual`` / ``fault_anchor``: a transfer failed on purpose (``corrupt_*`` / ``wrong_size_*``
  through ``custom_params``, which the router drops: these go straight to the pair with bootstrap host,
  port and room, as the router would send them). A residual fault must give the exact recompute
  output, an anchor fault a clear error that names it;
- ``abort``: a streaming request through the router whose client disconnects after the first chunk, or
  a request aborted by SGLang's ``/abort_request``; it must not disturb the others.

References (greedy, no fault) come from a pass at the start on the same deployment: per prompt the
output of an ordinary request and that of the recompute fallback (``lynx_test_ignore_residual``). A
greedy answer is checked against the reference of the path it reports (``meta_info.lynx_fallback``).
Every request has a deadline (``--request-timeout-s``); one with no answer by then is *lost*.

At the end: both servers answer ``/health_generate``, the Lynx staging, leases, tracked requests,
registered bytes and the decode KV pool's free count are back at idle (``/get_server_info``), and the
RSS of each server's process group is reported at the start and the end (sampled during the run).
Results: ``benchmark/reliability/results/soak.{json,md}``; exit status 1 on any lost / wrong response or
a failed idle check. The deployment is torn down on every exit path.
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmark.provenance import machine, provenance, settings_dict, stamp  # noqa: E402

from sglang_lynx.launch.server_state import idle_problems, lynx_state  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KINDS = ("ordinary", "sampled", "fault_residual", "fault_anchor", "abort")
OUTCOMES = ("correct", "clear_error", "aborted", "wrong", "lost")
RESIDUAL_FAULTS = {"corrupt_residual": "checksum mismatch", "wrong_size_residual": "wrong size"}
ANCHOR_FAULTS = {"corrupt_anchor": "checksum mismatch", "wrong_size_anchor": "wrong size"}
CONFIG = {"mode": "lynx", "residual_timeout_s": 8.0, "transfer_timeout_s": 30.0}


# ----------------------------------------------------------------------------------------- pure parts

@dataclass
class Result:
    """What one request saw. ``status`` None: no HTTP answer (connection failed or deadline passed)."""

    kind: str
    prompt: int
    seconds: float
    status: int | None
    body: Any = None
    fault: str | None = None
    abort_how: str | None = None
    timed_out: bool = False
    outcome: str = ""
    reason: str = ""


def error_text(status: int | None, body: Any) -> str | None:
    """The error a client saw (None: a normal answer with tokens)."""
    if status != 200:
        return body if isinstance(body, str) else json.dumps(body)
    if not isinstance(body, dict):
        return f"unexpected body {body!r:.200}"
    finish = (body.get("meta_info") or {}).get("finish_reason") or {}
    return json.dumps(finish) if isinstance(finish, dict) and finish.get("type") == "abort" else None


def _last(value: Any) -> Any:
    return value[-1] if isinstance(value, list) and value else value


def fallback_of(body: Any) -> str:
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    value = _last(meta.get("lynx_fallback"))
    return "" if value is None else str(value)


def classify(result: Result, refs: dict[str, list[int]] | None) -> tuple[str, str]:
    """(outcome, reason) of one request; ``refs``: ``{"ordinary": ids, "recompute": ids}`` of its prompt."""
    if result.timed_out or (result.status is None and result.kind != "abort"):
        return "lost", f"no answer: {str(result.body)[:200]}"
    err = error_text(result.status, result.body)
    if result.kind == "abort":
        if err is not None or result.abort_how == "disconnect":
            return "aborted", (err or "client disconnected")[:200]
        # the abort came too late: the request finished, so its answer must be right
        result = Result("ordinary", result.prompt, result.seconds, result.status, result.body)
    if result.kind == "fault_anchor":
        need = ANCHOR_FAULTS.get(result.fault or "", "?")
        if err is None:
            return "wrong", "a request whose anchor failed returned tokens"
        if need in err and "anchor" in err:
            return "clear_error", err[:200]
        return "wrong", f"error does not name the fault ({need}): {err[:200]}"
    if err is not None:
        return "wrong", f"unexpected error: {err[:200]}"
    ids = result.body.get("output_ids")
    if not ids:
        return "wrong", "no output tokens"
    if result.kind == "sampled":
        return "correct", "completed"
    fallback = fallback_of(result.body)
    if result.kind == "fault_residual":
        need = RESIDUAL_FAULTS.get(result.fault or "", "?")
        if not (fallback.startswith("recompute") and need in fallback):
            return "wrong", f"no recompute fallback naming {need!r}: {fallback!r}"
    if refs is None:
        return "wrong", "no reference"
    path = "recompute" if fallback.startswith("recompute") else "ordinary"
    if ids != refs[path]:
        return "wrong", f"output differs from the {path} reference"
    return "correct", path


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[Result]) -> dict[str, Any]:
    """Counts per kind and outcome, latency p50 / p95 per kind (answered requests), lost / wrong totals."""
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [r for r in results if r.kind == kind]
        if not mine:
            continue
        answered = [r.seconds for r in mine if r.outcome not in ("lost", "aborted")]
        p50, p95 = percentile(answered, 0.5), percentile(answered, 0.95)
        by_kind[kind] = {"requests": len(mine), **{o: sum(r.outcome == o for r in mine) for o in OUTCOMES},
                         "p50_s": None if p50 is None else round(p50, 2),
                         "p95_s": None if p95 is None else round(p95, 2)}
    answered_all = [r.seconds for r in results if r.outcome not in ("lost", "aborted")]
    p50, p95 = percentile(answered_all, 0.5), percentile(answered_all, 0.95)
    return {"requests": len(results), "by_kind": by_kind,
            "lost": sum(r.outcome == "lost" for r in results), "wrong": sum(r.outcome == "wrong" for r in results),
            "unclassified": sum(r.outcome not in OUTCOMES for r in results),
            "p50_s": None if p50 is None else round(p50, 2), "p95_s": None if p95 is None else round(p95, 2),
            "wrong_examples": [f"{r.kind}/{r.fault or r.abort_how or '-'}: {r.reason}"
                               for r in results if r.outcome == "wrong"][:10]}


def plan(n: int, fault_fraction: float, abort_fraction: float, sampled_fraction: float, prompts: int,
         seed: int) -> list[dict[str, Any]]:
    """The request mix, drawn once (seeded)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        spec: dict[str, Any] = {"prompt": rng.randrange(prompts)}
        if u < fault_fraction:
            fault = rng.choice([*RESIDUAL_FAULTS, *ANCHOR_FAULTS])
            spec.update(kind="fault_residual" if fault in RESIDUAL_FAULTS else "fault_anchor", fault=fault)
        elif u < fault_fraction + abort_fraction:
            spec.update(kind="abort", abort_how=rng.choice(["disconnect", "abort_request"]),
                        abort_after_s=round(rng.uniform(0.2, 2.0), 2))
        elif u < fault_fraction + abort_fraction + sampled_fraction:
            spec.update(kind="sampled")
        else:
            spec.update(kind="ordinary")
        out.append(spec)
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = ["| class | requests | correct | clear error | aborted | wrong | lost | p50 s | p95 s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, row in s["by_kind"].items():
        lines.append(f"| {kind} | {row['requests']} | {row['correct']} | {row['clear_error']} | {row['aborted']} | "
                     f"{row['wrong']} | {row['lost']} | {row['p50_s']} | {row['p95_s']} |")
    lines.append(f"| **all** | {s['requests']} | | | | **{s['wrong']}** | **{s['lost']}** | {s['p50_s']} | "
                 f"{s['p95_s']} |")
    mem = report.get("memory", {})
    lines += ["", "| server | RSS start MiB | RSS max MiB | RSS end MiB | growth MiB | idle at end | "
              "/health_generate |", "|---|---|---|---|---|---|---|"]
    for name, m in mem.items():
        lines.append(f"| {name} | {m.get('rss_start_mib')} | {m.get('rss_max_mib')} | {m.get('rss_end_mib')} | "
                     f"{m.get('rss_growth_mib')} | {'yes' if not m.get('idle_problems') else m['idle_problems']} | "
                     f"{m.get('health_generate')} |")
    lines += ["", f"Elapsed {report.get('soak_s')} s of soak; verdict: **{report.get('verdict')}**.", "",
              stamp(report.get("provenance"))]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- the run

def _post(url: str, payload: dict[str, Any], timeout: float) -> tuple[int | None, Any, bool]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return 200, json.loads(resp.read()), False
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(raw), False
        except json.JSONDecodeError:
            return exc.code, raw, False
    except TimeoutError as exc:
        return None, repr(exc), True
    except (urllib.error.URLError, OSError, ValueError) as exc:
        timed_out = "timed out" in str(exc)
        return None, repr(exc), timed_out


def group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in a process group (MiB)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return round(total / 1024, 1)


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


@dataclass
class Soak:
    pair: Any
    prompts: list[str]
    args: argparse.Namespace
    refs: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def _direct(self, text: str, sampling: dict[str, Any], timeout: float) -> tuple[int | None, Any, bool]:
        payload = {"text": text, "sampling_params": sampling, "bootstrap_host": self.pair.host,
                   "bootstrap_port": self.pair.bootstrap_port, "bootstrap_room": random.randint(0, 2**63 - 1)}
        prefill = threading.Thread(target=_post, args=(f"{self.pair.prefill_url}/generate", payload, timeout),
                                   daemon=True)
        prefill.start()
        got = _post(f"{self.pair.decode_url}/generate", payload, timeout)
        prefill.join(timeout=min(timeout, 60.0))
        return got

    def _greedy(self) -> dict[str, Any]:
        return {"max_new_tokens": self.args.max_new_tokens, "temperature": 0.0}

    def references(self) -> None:
        for i, text in enumerate(self.prompts):
            status, body, _ = _post(f"{self.pair.url}/generate", {"text": text, "sampling_params": self._greedy()},
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
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return None, repr(exc), "timed out" in str(exc)

    def one(self, spec: dict[str, Any]) -> Result:
        text, timeout = self.prompts[spec["prompt"]], self.args.request_timeout_s
        started = time.monotonic()
        kind = spec["kind"]
        if kind in ("fault_residual", "fault_anchor"):
            got = self._direct(text, {**self._greedy(), "custom_params": {"lynx_test_prefill_fault": spec["fault"]}},
                               timeout)
        elif kind == "abort" and spec["abort_how"] == "disconnect":
            got = self._stream_and_disconnect(text, spec["abort_after_s"], timeout)
        elif kind == "abort":
            rid = uuid.uuid4().hex

            def _abort() -> None:
                time.sleep(spec["abort_after_s"])
                for url in (self.pair.decode_url, self.pair.prefill_url):
                    _post(f"{url}/abort_request", {"rid": rid}, 30)

            aborter = threading.Thread(target=_abort, daemon=True)
            aborter.start()
            got = _post(f"{self.pair.url}/generate", {"text": text, "rid": rid, "sampling_params": self._greedy()},
                        timeout)
            aborter.join(timeout=60)
        elif kind == "sampled":
            got = _post(f"{self.pair.url}/generate", {"text": text, "sampling_params": {
                "max_new_tokens": self.args.max_new_tokens, "temperature": 0.8, "top_p": 0.95}}, timeout)
        else:
            got = _post(f"{self.pair.url}/generate", {"text": text, "sampling_params": self._greedy()}, timeout)
        status, body, timed_out = got
        result = Result(kind, spec["prompt"], round(time.monotonic() - started, 3), status, body,
                        spec.get("fault"), spec.get("abort_how"), timed_out)
        result.outcome, result.reason = classify(result, self.refs.get(spec["prompt"]))
        if isinstance(result.body, dict):  # keep the record small
            meta = result.body.get("meta_info") or {}
            result.body = {"output_ids_len": len(result.body.get("output_ids") or []),
                           "finish_reason": meta.get("finish_reason"), "lynx_fallback": fallback_of(result.body),
                           **{k: v for k, v in result.body.items() if k == "disconnected_after_s"}}
        return result

    def sample(self, label: str) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(time.monotonic(), 1), "label": label}
        for proc in self.pair.processes:
            if proc.name in ("prefill", "decode") and proc.popen is not None:
                row[f"{proc.name}_rss_mib"] = group_rss_mib(proc.popen.pid)
        for name, url in (("prefill", self.pair.prefill_url), ("decode", self.pair.decode_url)):
            state = lynx_state(url)
            if state:
                row[f"{name}_staging_free"] = state["staging"]["free_bytes"]
                row[f"{name}_tracked"] = state.get("tracked_requests")
                if name == "decode":
                    row["decode_kv_pool_free"] = state.get("kv_pool_free_tokens")
        self.samples.append(row)
        return row

    def run(self, specs: list[dict[str, Any]]) -> tuple[list[Result], float]:
        results: list[Result] = []
        lock = threading.Lock()
        deadline = time.monotonic() + self.args.duration_s
        queue = list(specs)
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set() and time.monotonic() < deadline:
                with lock:
                    if not queue:
                        return
                    spec = queue.pop(0)
                res = self.one(spec)
                with lock:
                    results.append(res)
                    n = len(results)
                if res.outcome in ("wrong", "lost") or n % 10 == 0:
                    print(f"[soak] {n} done ({time.monotonic() - deadline + self.args.duration_s:.0f} s): last "
                          f"{res.kind} {res.outcome} {res.seconds:.1f} s {res.reason[:120]}", flush=True)

        def sampler() -> None:
            while not stop.wait(self.args.sample_every_s):
                with contextlib.suppress(Exception):
                    self.sample("during")

        started = time.monotonic()
        sam = threading.Thread(target=sampler, daemon=True)
        sam.start()
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(self.args.concurrency)]
            for fut in futures:  # each worker stops taking work at the deadline; one request's bound after it
                fut.result(timeout=self.args.duration_s + self.args.request_timeout_s * 2 + 120)
        stop.set()
        sam.join(timeout=60)
        return results, time.monotonic() - started


def wait_idle(url: str, baseline: dict[str, Any], timeout_s: float) -> tuple[list[str], float]:
    started = time.monotonic()
    problems: list[str] = []
    while time.monotonic() - started < timeout_s:
        problems = idle_problems(lynx_state(url), baseline)
        if not problems:
            break
        time.sleep(1.0)
    return problems, round(time.monotonic() - started, 1)


def health_generate(url: str, timeout_s: float = 120.0) -> str:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        status, _, _ = _post_get(f"{url}/health_generate")
        if status == 200:
            return f"ok ({time.monotonic() - started:.1f} s)"
        time.sleep(2)
    return "no answer"


def _post_get(url: str) -> tuple[int | None, Any, bool]:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status, None, False
    except urllib.error.HTTPError as exc:
        return exc.code, None, False
    except (urllib.error.URLError, OSError) as exc:
        return None, repr(exc), False


def make_prompts(n: int, lo: int, hi: int) -> list[str]:
    from sglang_lynx.launch.client import haystack

    sizes = [int(lo + (hi - lo) * i / max(n - 1, 1)) for i in range(n)]
    return [" ".join(haystack(size, seed=100 + i)) + "\nQuestion: which log mentions the tides? Answer:"
            for i, size in enumerate(sizes)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--fault-fraction", type=float, default=0.1)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--sampled-fraction", type=float, default=0.1)
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts (references are per prompt)")
    p.add_argument("--min-tokens", type=int, default=240, help="haystack size (~1.3 tokens each)")
    p.add_argument("--max-tokens", type=int, default=1100)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=240.0)
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--staging-mb", type=int, default=128, help="each Lynx arena (send_arena_mb / receive_arena_mb)")
    p.add_argument("--max-total-tokens", default="8192")
    p.add_argument("--min-available-gib", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a fresh temp dir)")
    args = p.parse_args(argv)

    from benchmark.pd_modes import default_model_path

    from sglang_lynx.launch.deployment import PDDeployment

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
    config = {**CONFIG, "send_arena_mb": args.staging_mb, "receive_arena_mb": args.staging_mb}
    specs = plan(args.max_requests, args.fault_fraction, args.abort_fraction, args.sampled_fraction,
                 args.prompts, args.seed)
    server_args = ["--max-total-tokens", args.max_total_tokens, "--dtype", "float32",
                   "--disable-overlap-schedule", "--lynx", "--lynx-config", json.dumps(config)]
    report: dict[str, Any] = {"settings": settings_dict(args), "config": config, "provenance": prov}
    pair = PDDeployment(model, extra_args=server_args, log_dir=args.log_dir)
    try:
        with pair:
            print("[soak] starting the pair", flush=True)
            report["start_s"] = round(pair.start(timeout_s=600), 1)
            report["log_dir"] = str(pair.log_dir)
            print(f"[soak] pair up in {report['start_s']} s (logs {pair.log_dir})", flush=True)
            soak = Soak(pair, prompts, args)
            soak.references()
            baseline = {"prefill": lynx_state(pair.prefill_url), "decode": lynx_state(pair.decode_url)}
            start_row = soak.sample("start")
            results, elapsed = soak.run(specs)
            report["soak_s"] = round(elapsed, 1)
            memory: dict[str, Any] = {}
            for name, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url)):
                problems, took = wait_idle(url, baseline[name] or {}, 120.0)
                memory[name] = {"idle_problems": problems, "idle_after_s": took,
                                "health_generate": health_generate(url)}
            end_row = soak.sample("end")
            for name in ("prefill", "decode"):
                during = [s[f"{name}_rss_mib"] for s in soak.samples if f"{name}_rss_mib" in s]
                memory[name].update(rss_start_mib=start_row.get(f"{name}_rss_mib"),
                                    rss_end_mib=end_row.get(f"{name}_rss_mib"), rss_max_mib=max(during, default=None))
                m = memory[name]
                if m["rss_start_mib"] is not None and m["rss_end_mib"] is not None:
                    m["rss_growth_mib"] = round(m["rss_end_mib"] - m["rss_start_mib"], 1)
            report.update(memory=memory, baseline=baseline, samples=soak.samples,
                          summary=summarize(results), results=[asdict(r) for r in results])
    finally:
        prov["machine_end"] = machine()
    s = report["summary"]
    idle_ok = all(not m["idle_problems"] and m["health_generate"].startswith("ok") for m in report["memory"].values())
    report["verdict"] = "pass" if s["lost"] == 0 and s["wrong"] == 0 and s["unclassified"] == 0 and idle_ok else "FAIL"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "soak.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report)
    (args.out_dir / "soak.md").write_text(md)
    print(md)
    return 0 if report["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
