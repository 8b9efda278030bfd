"""Time to the k-th token per Lynx mode at several transfer/decode-step ratios, through the router.

For each mode one PD deployment (prefill + decode over Mooncake + sglang_router, default model) is
started with ``--lynx --lynx-config MODE`` (mode ``raw``: stock SGLang PD, no ``--lynx``). The KV
crosses an emulated link (this machine's loopback is far faster than a datacenter link relative to its
decode speed), re-rated per (context, ratio) so one deployment is measured at every ratio without
restarting: ``--link pacer`` (default) paces the Lynx streams in the prefill's transfer scheduler,
rate read from a file (``raw`` is not paced: do not compare it there); ``--link shaped`` puts the
prefill in a network namespace behind a veth shaped by tc tbf (root only), which every
prefill->decode byte crosses, ``raw``'s included (``launch/links.py``).

**Ratio.** ``ratio = (bf16 KV bytes of the prompt / link rate) / decode step``: how many decode steps
moving the uncompressed KV would take. The decode step and the prompt length per context are measured
once, at the start, on the first mode's deployment with an unthrottled link (median gap between
tokens 2..64 of one greedy request); the link rate for each (context, ratio) follows from them and is
the same for every mode, so modes differ only in how many bytes they send and when decoding starts.

Every (context, ratio) gets its own needle prompts (the same ones in every mode), so no request hits
the prefill's prefix cache. Each request streams native ``/generate`` (greedy, ``ignore_eos`` so every request yields
``--max-tokens`` tokens); the client records when each token arrives (``meta_info.completion_tokens``
counts verified drafts released together) and keeps the final ``lynx_*`` fields (drafts, accepted,
verify time, anchor/residual landed).

    python benchmark/serving/bench_ttkt.py --modes bf16 int8 int4 lynx-int4 lynx-int8 lynx \\
        --context-tokens 1024 4096 --ratios 4 16 64 --requests 2
    python benchmark/serving/bench_ttkt.py --link shaped --modes raw int8 lynx --out ...   # as root

Writes ``ttkt-rows.jsonl`` (each request as it finishes), ``ttkt.json`` (provenance, calibration,
rows, table), ``ttkt.md``, ``ttkt-bars.png`` and ``ttkt-timeline.png`` under ``--out`` and prints
the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.model_shape import kv_shape  # noqa: E402
from benchmark.pd_modes import mode_server_args, stop_on_sigterm  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from benchmark.serving.ttkt_report import KS, LYNX_FIELDS, markdown, plot_bars, plot_timeline, summarize  # noqa: E402

from sglang_lynx.launch.client import StreamResult, needle_prompt, stream_generate  # noqa: E402
from sglang_lynx.launch.deployment import PDDeployment  # noqa: E402
from sglang_lynx.launch.links import open_deployment_link, place_on_link  # noqa: E402
from sglang_lynx.launch.processes import ServerStartError  # noqa: E402
from sglang_lynx.models.prepare import prepare  # noqa: E402
from sglang_lynx.transfer.link import Link, LinkKind  # noqa: E402
from sglang_lynx.transfer.trace import TRACE_ENV  # noqa: E402

UNTHROTTLED_GBPS = 5000.0
SHAPED_UNTHROTTLED_GBPS = 20.0  # tc tbf's burst grows with the rate: keep it sane for the calibration


def _prompt(tokenizer: Any, ctx: int, seed: int) -> tuple[str, str]:
    messages, secret = needle_prompt(ctx, seed=seed, depth=(seed % 5) / 4)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), secret


def _request(url: str, text: str, max_tokens: int) -> tuple[StreamResult, str]:
    try:
        res = stream_generate(url, text, max_new_tokens=max_tokens, ignore_eos=True)
        return res, "" if len(res.chunk_times) >= max_tokens else f"only {len(res.chunk_times)} tokens"
    except (OSError, ValueError) as exc:  # urllib errors are OSErrors
        return StreamResult(), repr(exc)


def set_link_rate(link: Link, rate_file: Path, gbps: float) -> None:
    """Re-rate the emulated link: tc on the shaped link, the pacer's rate file otherwise."""
    if link.kind is LinkKind.NETNS_TBF:
        link.set_rate(min(gbps, SHAPED_UNTHROTTLED_GBPS))
    else:
        rate_file.write_text(f"{gbps:.6f}")
        time.sleep(0.5)  # the pacer re-reads its file every 0.2 s


FLOOR_REQUESTS = 2  # calibration requests after the first (which also warms the deployment) timed for the floor


def calibrate(url: str, tokenizer: Any, contexts: list[int], max_tokens: int, rate_file: Path,
              link: Link) -> dict[int, dict]:
    """Per context, on an unthrottled link: prompt tokens, the decode step (median token gap) and the TT1T
    floor (the fastest first token of ``FLOOR_REQUESTS`` more requests with their own prompts: the
    prefill, a negligible transfer and one step, which bounds every mode's TT1T from below)."""
    set_link_rate(link, rate_file, UNTHROTTLED_GBPS)
    out = {}
    for ctx in contexts:
        text, _ = _prompt(tokenizer, ctx, seed=100)
        res, error = _request(url, text, max_tokens)
        if error:
            raise RuntimeError(f"calibration request at {ctx} tokens failed: {error}")
        gaps = [b - a for a, b in zip(res.chunk_times[1:], res.chunk_times[2:], strict=False) if b > a]
        firsts = []
        for seed in range(101, 101 + FLOOR_REQUESTS):  # distinct prompts: no prefix-cache hit on the prefill
            again, error = _request(url, _prompt(tokenizer, ctx, seed)[0], 2)
            if not error and again.chunk_times:
                firsts.append(again.chunk_times[0])
        out[ctx] = {"prompt_tokens": int(res.usage["prompt_tokens"]), "step_s": statistics.median(gaps),
                    "tt1t_floor_s": min(firsts) if firsts else None}
        floor = f"{out[ctx]['tt1t_floor_s']:.2f} s" if firsts else "not measured"
        print(f"[calibrate] ctx {ctx}: {out[ctx]['prompt_tokens']} prompt tokens, "
              f"decode step {out[ctx]['step_s'] * 1e3:.1f} ms, TT1T floor {floor}", flush=True)
    return out


# The router checks each server's /health every 60 s and drops it after 3 failures in a row; SGLang's
# /health fails while one forward outlasts SGLANG_HEALTH_CHECK_TIMEOUT (20 s), which every 7.9K-token prefill on
# this CPU does (36-48 s): stock SGLang's prefill was dropped mid-run and its requests got HTTP 503
# (results/ttkt-sweep-8k/, ttkt-exact-pieces-8k/). Every mode gets the same, more patient router.
ROUTER_ARGS = ["--health-failure-threshold", "10"]


def flush_prefill_caches(dep: PDDeployment) -> None:
    """Empty every prefill's radix cache (SGLang's ``/flush_cache``) before a mode's measured requests, so every
    mode meets them in the same cache state: a cached chat-template prefix moves the chunk boundary of a prompt
    longer than one prefill chunk, which changes its bf16 KV, and its text, in every mode alike (stock SGLang
    included; ``results/ttkt-shaped-5k/reruns/README.md``). Without it ``text = raw`` would compare cache states."""
    import urllib.request

    for url in dep.prefill_urls:  # a refusal (requests still running) is an HTTPError: the run stops
        urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=60).close()


def last_value(value: Any) -> Any:
    """SGLang repeats a ``customized_info`` field once per output token: the last one is current."""
    return value[-1] if isinstance(value, list) and value else value


def link_gbps(calib: dict, ratio: float, bytes_per_token: int) -> float:
    transfer_s = ratio * calib["step_s"]
    return calib["prompt_tokens"] * bytes_per_token * 8 / transfer_s / 1e9


def run_mode(model: str, mode: str, args: argparse.Namespace, tokenizer: Any, rate_file: Path, link: Link,
             calibration: dict[int, dict], bytes_per_token: int, rows_file: Path) -> list[dict[str, Any]]:
    extra = ["--max-total-tokens", str(max(args.context_tokens) * 2 + 4096)]
    extra = mode_server_args(mode, extra)
    rows = []
    if args.trace:  # the servers inherit it: one trace directory per mode (transfer/trace.py)
        os.environ[TRACE_ENV] = str((args.out / "trace" / mode).resolve())
    dep = PDDeployment(model, extra_args=extra, log_dir=args.out / "logs" / mode, router_args=ROUTER_ARGS)
    place_on_link(dep, link)
    with dep:
        print(f"[{mode}] deployment up in {dep.start(timeout_s=900):.0f} s", flush=True)
        if not calibration:
            calibration.update(calibrate(dep.url, tokenizer, args.context_tokens, args.max_tokens, rate_file, link))
        flush_prefill_caches(dep)
        for ctx in args.context_tokens:
            for r, ratio in enumerate(args.ratios):
                gbps = link_gbps(calibration[ctx], ratio, bytes_per_token)
                set_link_rate(link, rate_file, gbps)
                # distinct prompts per ratio (the same ones in every mode): no prefix-cache hit on the prefill
                for seed in range(r * args.requests, (r + 1) * args.requests):
                    text, secret = _prompt(tokenizer, ctx, seed)
                    sent_at = time.time()
                    res, error = _request(dep.url, text, args.max_tokens)
                    row: dict[str, Any] = {"mode": mode, "context": ctx, "ratio": ratio, "link_gbps": gbps,
                                           "seed": seed, "sent_at": sent_at,
                                           "tokens": len(res.chunk_times), "error": error,
                                           "found": secret in res.text, "text": res.text,
                                           "token_times": res.chunk_times,
                                           "prompt_tokens": res.usage.get("prompt_tokens")}
                    for k in KS:
                        row[f"tt{k}t"] = res.chunk_times[k - 1] if len(res.chunk_times) >= k else None
                    row.update({f: last_value(res.meta.get(f)) for f in LYNX_FIELDS})
                    rows.append(row)
                    with rows_file.open("a") as fh:  # every row on disk at once: a crash later loses none
                        fh.write(json.dumps(row) + "\n")
                    tt1t = f"{row['tt1t']:.2f}" if row["tt1t"] is not None else "-"
                    tt32t = f"{row['tt32t']:.2f}" if row["tt32t"] is not None else "-"
                    print(f"[{mode}] ctx {ctx} ratio {ratio:g} ({gbps:.3f} Gb/s) seed {seed}: TT1T {tt1t} s, "
                          f"TT32T {tt32t} s, drafts {row['lynx_drafts']}, accepted {row['lynx_accepted']} {error}",
                          flush=True)
    return rows


def render(out: Path) -> int:
    data = json.loads((out / "ttkt.json").read_text())
    meta = {k: v for k, v in data.items() if k not in ("rows", "table")}
    if "kv_shape" not in meta:  # a run from before it was recorded: every run serves the default model
        meta["kv_shape"] = asdict(kv_shape(str(prepare("smollm2-135m"))))
    table = summarize(data["rows"])
    (out / "ttkt.md").write_text(markdown(table, meta))
    plot_bars(table, out / "ttkt-bars.png", meta.get("provenance"))
    plot_timeline(data["rows"], out / "ttkt-timeline.png", meta.get("provenance"))
    print(markdown(table, meta))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4", "lynx-int4", "lynx-int8", "lynx"])
    parser.add_argument("--context-tokens", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--ratios", nargs="+", type=float, default=[4, 16, 64])
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmark/serving/results/ttkt"))
    parser.add_argument("--link", choices=["pacer", "shaped"], default="pacer",
                        help="pacer: the Lynx streams paced in the prefill; shaped: netns + veth + tc tbf (root)")
    parser.add_argument("--trace", action="store_true",
                        help="the servers write a transfer timeline to <out>/trace/<mode> (SGLANG_LYNX_TRACE_DIR); "
                             "benchmark/serving/trace_report.py reads it")
    parser.add_argument("--render-only", action="store_true",
                        help="start nothing: redraw the tables and plots from <out>/ttkt.json")
    args = parser.parse_args()
    stop_on_sigterm()
    if args.render_only:
        return render(args.out)
    if args.max_tokens < max(KS):
        parser.error(f"--max-tokens must be >= {max(KS)} (TT{max(KS)}T is reported)")
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(prepare("smollm2-135m"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rate_file = args.out / "link-gbps"
    rate_file.write_text(str(UNTHROTTLED_GBPS))
    if args.link == "shaped":
        link = open_deployment_link("shaped", SHAPED_UNTHROTTLED_GBPS)
        print(f"[link] {link.describe()}", flush=True)
    else:
        link = Link(UNTHROTTLED_GBPS, LinkKind.PACER, reason="rate file")
        os.environ["SGLANG_LYNX_LINK_GBPS"] = f"@{rate_file.resolve()}"
    shape = kv_shape(model)
    bytes_per_token = shape.bytes_per_token
    calibration: dict[int, dict] = {}
    rows: list[dict[str, Any]] = []
    rows_file = args.out / "ttkt-rows.jsonl"
    rows_file.write_text("")
    stopped = ""
    with link:
        try:
            for mode in args.modes:
                try:
                    rows += run_mode(model, mode, args, tokenizer, rate_file, link, calibration, bytes_per_token,
                                     rows_file)
                except ServerStartError as exc:
                    print(f"[{mode}] deployment failed to start: {str(exc)[:500]}", flush=True)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (stop_on_sigterm): keep what was measured
            stopped = f"stopped ({exc or 'interrupt'}) after {len(rows)} requests"
            print(f"[ttkt] {stopped}; writing what was measured", flush=True)
    link_name = ("netns+veth+tc-tbf (all prefill->decode traffic)" if link.kind is LinkKind.NETNS_TBF
                 else "application pacer (Lynx streams)") + ", rate per (context, ratio) from the calibration"
    write_results(args.out, rows, {"bf16_kv_bytes_per_token": bytes_per_token, "kv_shape": asdict(shape),
                                   "calibration": {str(k): v for k, v in calibration.items()}, "link": link_name},
                  stopped)
    return 130 if stopped else 0


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], stopped: str = "") -> None:
    """``ttkt.json`` (provenance, ``meta``, rows, table), ``ttkt.md`` and the plots. A run stopped early says so:
    ``stopped`` in the JSON and a first line in the Markdown; its cells hold the requests it finished."""
    table = summarize(rows)
    meta = {"provenance": provenance(), **meta, **({"stopped": stopped} if stopped else {})}
    (out / "ttkt.json").write_text(json.dumps({**meta, "rows": rows, "table": table}, indent=2))
    text = (f"**{stopped}: the last mode's cells are incomplete.**\n\n" if stopped else "") + markdown(table, meta)
    (out / "ttkt.md").write_text(text)
    if table:
        plot_bars(table, out / "ttkt-bars.png", meta["provenance"])
        plot_timeline(rows, out / "ttkt-timeline.png", meta["provenance"])
    print(text)


if __name__ == "__main__":
    sys.exit(main())
