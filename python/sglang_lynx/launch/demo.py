"""The demo: one long-context request through PD deployments of several modes on one emulated link.

Lifecycle: for each mode (the one named after ``--``, ``lynx`` when none is, then ``--compare``,
default ``int8`` and ``raw`` = stock SGLang PD without ``--lynx``) start a PD deployment on the link,
wait until it routes, read the link's byte counters (shaped link), send the same needle-in-a-haystack
prompt (chat template, greedy, ``ignore_eos``, ``--max-tokens`` tokens) streaming through the router,
read the counters again, stop the deployment. Then print one table: TT1T/TT32T (seconds from sending
to the 1st/32nd token), the anchor / residual land times and drafts / accepted (``lynx_*`` fields of
the decode's ``meta_info``, times since the decode got the request), the bytes that crossed the link
towards the decode, and the answer. The same prompt in every deployment; every deployment is fresh,
so no prefix cache helps a later one.

The link defaults to 0.025 Gb/s (3.1 MB/s): at ~1.4K prompt tokens (``--context-tokens 1024``) the bf16
KV of SmolLM2-135M (23,040 B/token, 33 MB with SGLang's framing) takes ~11 s to cross, int8's 17.7 MB
~5.7 s and lynx's anchor ~3 s. Every Lynx mode queues each layer's KV while the prefill computes the next
one, so a mode's transfer only shows once it takes longer than the prefill (~3 s on a 2-core CPU):
at 0.05 Gb/s int8's bytes (2.8 s) already fit behind that prefill on such a host and lynx has nothing to
win over int8; at 0.025 Gb/s the transfer is the bottleneck the project is for, and the decode drafts on
the anchor while the residual crosses. A faster host (a shorter prefill) shows it at faster links.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_lynx.launch.client import needle_prompt, stream_generate
from sglang_lynx.launch.deployment import PDDeployment
from sglang_lynx.launch.links import place_on_link
from sglang_lynx.launch.processes import ServerStartError
from sglang_lynx.transfer.link import Link, LinkKind

DEFAULT_DEMO_GBPS = 0.025
RAW = "raw"


def requested_mode(extra: list[str]) -> str:
    """The mode the flags after ``--`` name: ``--lynx-config X`` with ``--lynx``, ``lynx`` when no
    ``--lynx`` is given (the demo is about it)."""
    if "--lynx" not in extra:
        return "lynx"
    for i, flag in enumerate(extra):
        if flag == "--lynx-config" and i + 1 < len(extra):
            return extra[i + 1]
        if flag.startswith("--lynx-config="):
            return flag.split("=", 1)[1]
    return "lynx"


def flags_for(extra: list[str], mode: str) -> list[str]:
    """``extra`` with its ``--lynx`` / ``--lynx-config`` replaced by ``mode``'s (none for ``raw``)."""
    kept, skip = [], False
    for flag in extra:
        if skip:
            skip = False
        elif flag == "--lynx-config":
            skip = True
        elif flag != "--lynx" and not flag.startswith("--lynx-config="):
            kept.append(flag)
    return kept if mode == RAW else ["--lynx", "--lynx-config", mode, *kept]


@dataclass
class DemoRow:
    mode: str
    tt1t: float | None = None
    tt32t: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    anchor_landed_s: float | None = None
    residual_landed_s: float | None = None
    drafts: int | None = None
    accepted: int | None = None
    bonus: int | None = None  # tokens the verify released after a fully accepted draft window
    to_decode_bytes: int | None = None  # crossed the shaped link towards the decode during the request
    to_prefill_bytes: int | None = None
    answer: str = ""
    found: bool = False
    start_s: float | None = None
    load_avg_1m: float | None = None  # the host's 1-minute load average when the request finished
    error: str = ""


def _last(value: Any) -> Any:
    """SGLang repeats a ``customized_info`` field once per output token: the last one is current."""
    return value[-1] if isinstance(value, list) and value else value


def _prompt_text(model_path: str, context_tokens: int) -> tuple[str, str]:
    from transformers import AutoTokenizer

    messages, secret = needle_prompt(context_tokens)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)), secret


def run_mode(model_path: str, extra: list[str], link: Link, args: argparse.Namespace, mode: str,
             text: str, secret: str) -> DemoRow:
    row = DemoRow(mode)
    log_dir = None if args.log_dir is None else args.log_dir / mode
    dep = PDDeployment(model_path, host=args.host, extra_args=flags_for(extra, mode), log_dir=log_dir,
                       transfer_backend=args.transfer_backend, prefills=args.prefill, decodes=args.decode,
                       base_gpu_id=args.base_gpu_id, mem_fraction=args.mem_fraction)
    place_on_link(dep, link)
    print(f"[lynx] [{mode}] starting a PD deployment (logs: {dep._logs()})", flush=True)
    try:
        with dep:
            row.start_s = dep.start(timeout_s=args.timeout, progress=sys.stdout.isatty())
            shaped = link.kind is LinkKind.NETNS_TBF
            before = link.sent_bytes() if shaped else (0, 0)
            res = stream_generate(dep.url, text, max_new_tokens=args.max_tokens, timeout=600, ignore_eos=True)
            row.load_avg_1m = round(os.getloadavg()[0], 2)
            if shaped:
                after = link.sent_bytes()
                row.to_decode_bytes, row.to_prefill_bytes = after[1] - before[1], after[0] - before[0]
    except (ServerStartError, OSError, ValueError) as exc:
        row.error = str(exc).splitlines()[0][:300] if str(exc) else repr(exc)
        print(f"[lynx] [{mode}] failed: {row.error}", flush=True)
        return row
    times = res.chunk_times
    row.tokens, row.prompt_tokens = len(times), res.usage.get("prompt_tokens")
    row.tt1t = times[0] if times else None
    row.tt32t = times[31] if len(times) >= 32 else None
    row.anchor_landed_s = _last(res.meta.get("lynx_anchor_landed_s"))
    row.residual_landed_s = _last(res.meta.get("lynx_residual_landed_s"))
    row.drafts, row.accepted = _last(res.meta.get("lynx_drafts")), _last(res.meta.get("lynx_accepted"))
    row.bonus = _last(res.meta.get("lynx_bonus"))
    row.answer = res.text.strip().splitlines()[0][:72] if res.text.strip() else ""
    row.found = secret in res.text
    print(f"[lynx] [{mode}] TT1T {_s(row.tt1t)}, TT32T {_s(row.tt32t)}, drafts {row.drafts}, "
          f"accepted {row.accepted}, bonus {row.bonus}", flush=True)
    return row


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def table(rows: list[DemoRow]) -> str:
    head = (f"{'mode':<10} {'TT1T':>7} {'TT32T':>7} {'anchor':>7} {'residual':>8} {'drafts':>6} "
            f"{'accepted':>8} {'bonus':>5} {'MB->dec':>7} {'load':>5}  answer")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.mode:<10} failed: {r.error}")
            continue
        lines.append(f"{r.mode:<10} {_s(r.tt1t):>7} {_s(r.tt32t):>7} {_s(r.anchor_landed_s):>7} "
                     f"{_s(r.residual_landed_s):>8} {str(r.drafts if r.drafts is not None else '-'):>6} "
                     f"{str(r.accepted if r.accepted is not None else '-'):>8} "
                     f"{str(r.bonus if r.bonus is not None else '-'):>5} {_mb(r.to_decode_bytes):>7} "
                     f"{r.load_avg_1m or 0:>5.1f}  "
                     f"{r.answer!r}{'' if r.found else ' (passphrase not found)'}")
    first = rows[0]
    for other in rows[1:]:
        for k in ("tt1t", "tt32t"):
            mine, theirs = getattr(first, k), getattr(other, k)
            if mine and theirs:
                lines.append(f"{k.upper()}({other.mode}) / {k.upper()}({first.mode}) = {theirs / mine:.2f}")
    return "\n".join(lines)


def _machine() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cpus"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def run_demo(model_path: str, extra: list[str], link: Link, args: argparse.Namespace) -> int:
    modes = list(dict.fromkeys([requested_mode(extra), *args.compare]))
    text, secret = _prompt_text(model_path, args.context_tokens)
    print(f"[lynx] demo: one ~{args.context_tokens}-token needle-in-a-haystack request, {args.max_tokens} "
          f"greedy tokens, through {', '.join(modes)} (one deployment after another)", flush=True)
    rows = [run_mode(model_path, extra, link, args, mode, text, secret) for mode in modes]
    prompt_tokens = next((r.prompt_tokens for r in rows if r.prompt_tokens), None)
    print(f"\n[lynx] link: {link.describe()}; prompt tokens: {prompt_tokens}; times in seconds from sending "
          "(anchor/residual: since the decode got the request); MB->dec: bytes that crossed the link "
          "towards the decode during the request; load: the host's 1-minute load average then")
    print(table(rows), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"link": link.describe(), "link_kind": link.kind.value, "link_gbps": link.gbps,
                "context_tokens": args.context_tokens, "max_tokens": args.max_tokens, "extra": extra,
                "model_path": model_path, "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "machine": _machine(), "command": "python -m sglang_lynx.launch " + " ".join(args.argv),
                "rows": [asdict(r) for r in rows], "table": table(rows)}
        args.json.write_text(json.dumps(meta, indent=2) + "\n")
    return 0 if all(not r.error and r.tokens for r in rows) else 1
