"""``python -m sglang_lynx.launch {pd,single,demo} [options] [-- extra SGLang flags]``.

pd      start prefill + decode (Mooncake) + router, print the endpoint, serve until Ctrl-C
        (``--prefill N --decode M``: N prefill and M decode servers behind the one router; default 1 and 1)
single  start one ordinary SGLang server
demo    on an emulated slow link, send one real long-context request through a PD deployment of the
        mode given after ``--`` (e.g. ``lynx``) and then through ``int8`` and ``raw`` deployments
        (``--compare``), print the answer, TT1T/TT32T, the anchor/residual land times, drafts and
        accepted, and the bytes that crossed the link; shut everything down

Links (``--link``): ``none`` (loopback), ``pacer`` (the Lynx streams paced in the prefill, SGLang's own
transfers not), ``shaped`` (prefills in a network namespace behind a veth pair shaped by tc tbf at
``--link-gbps``, optional ``--link-delay-ms``: all prefill->decode traffic crosses it; needs root and
ip/tc), ``auto`` (shaped when it can, else the pacer). pd: ``auto`` when ``--link-gbps`` is given,
else ``none``; demo: ``auto`` at 0.025 Gb/s.

Flags after ``--`` go to every SGLang server (for example ``-- --lynx --lynx-config lynx-int8``; no
``--lynx``: stock SGLang PD, the mode ``raw``). On a CUDA host each server gets its own GPUs
(``--base-gpu-id``: the first one; ``--mem-fraction``: every server's ``--mem-fraction-static``; see
``launch/gpus.py``); ``--dry-run`` prints the commands. Everything (servers, namespace, veth, qdiscs) stops
cleanly on Ctrl-C, on exit or when any one process dies.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from sglang_lynx.launch.demo import DEFAULT_DEMO_GBPS, run_demo
from sglang_lynx.launch.deployment import PDDeployment, SingleServer, default_transfer_backend
from sglang_lynx.launch.gpus import GpuPlacementError
from sglang_lynx.launch.links import LINK_CHOICES, link_banner, open_deployment_link, place_on_link
from sglang_lynx.launch.processes import ServerStartError
from sglang_lynx.models.catalog import DEFAULT_MODEL, MODELS
from sglang_lynx.transfer.link import Link, LinkSetupError


def _resolve_model(args: argparse.Namespace) -> str:
    if args.model_path:
        return str(args.model_path)
    from sglang_lynx.models.prepare import prepare

    return str(prepare(args.model))


def _serve_forever(deployment: Any) -> int:
    print(f"[lynx] endpoint: {deployment.url}   (logs: {deployment.log_dir}; Ctrl-C to stop)", flush=True)
    try:
        while deployment.alive():
            time.sleep(1.0)
        dead = [p.name for p in deployment.processes if not p.alive]
        print(f"[lynx] {', '.join(dead)} exited; stopping the deployment", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[lynx] stopping", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m sglang_lynx.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["pd", "single", "demo"])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--model-path", type=Path, default=None,
                        help="an HF checkpoint (default: the prepared --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address every server binds to (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="router (pd) or server (single) port; 0 = a free one")
    parser.add_argument("--prefill", type=int, default=1, metavar="N", help="pd/demo: prefill servers (default 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="M", help="pd/demo: decode servers (default 1)")
    parser.add_argument("--transfer-backend", default=default_transfer_backend())
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health")
    parser.add_argument("--context-tokens", type=int, default=1024, help="demo: size of the long context")
    parser.add_argument("--max-tokens", type=int, default=32, help="demo: tokens to generate (greedy)")
    parser.add_argument("--compare", nargs="*", default=["int8", "raw"], metavar="MODE",
                        help="demo: modes run after the one given after -- (raw: no --lynx; default int8 raw)")
    parser.add_argument("--json", type=Path, default=None, help="demo: write the results here")
    parser.add_argument("--base-gpu-id", type=int, default=0,
                        help="CUDA hosts: the first GPU; server i gets GPUs base + i*tp .. (default 0)")
    parser.add_argument("--mem-fraction", type=float, default=None,
                        help="CUDA hosts: --mem-fraction-static of every server (default: SGLang's; "
                             "servers sharing a GPU split 0.8 of it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every server's command line (with its GPUs) and exit")
    parser.add_argument("--link", choices=LINK_CHOICES, default=None,
                        help="the prefill->decode link (see above; default: pd auto if --link-gbps, else none; "
                             "demo auto)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help=f"the link's rate in Gb/s (demo default {DEFAULT_DEMO_GBPS})")
    parser.add_argument("--link-delay-ms", type=float, default=0.0,
                        help="shaped link: one-way delay in each direction (tc netem)")
    args = parser.parse_args(argv)
    args.argv = [*argv, "--", *extra] if extra else argv
    if args.prefill < 1 or args.decode < 1:
        parser.error(f"--prefill and --decode must be >= 1 (got {args.prefill} and {args.decode})")
    if args.command == "single" and (args.prefill, args.decode) != (1, 1):
        parser.error("--prefill/--decode apply to pd and demo, not to single")
    if args.command == "single" and (args.link not in (None, "none") or args.link_gbps is not None):
        parser.error("--link/--link-gbps apply to pd and demo (a link between prefill and decode), not to single")
    if args.command == "demo":
        args.link = args.link or "auto"
        if args.link != "none" and args.link_gbps is None:
            args.link_gbps = DEFAULT_DEMO_GBPS
    args.link = args.link or ("auto" if args.link_gbps is not None else "none")

    if args.dry_run:
        return _dry_run(parser, args, extra)

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)
    model_path = _resolve_model(args)
    try:
        link = open_deployment_link(args.link, args.link_gbps, args.link_delay_ms)
    except LinkSetupError as exc:
        print(f"[lynx] link set-up failed: {exc}", file=sys.stderr)
        return 1
    with link:
        print(link_banner(link), flush=True)
        if args.command == "demo":
            try:
                return run_demo(model_path, extra, link, args)
            except KeyboardInterrupt:
                print("\n[lynx] interrupted; stopped", flush=True)
                return 130
        return _run(args, model_path, extra, link)


def _deployment(args: argparse.Namespace, model_path: str, extra: list[str]) -> PDDeployment | SingleServer:
    gpu = dict(base_gpu_id=args.base_gpu_id, mem_fraction=args.mem_fraction)
    if args.command == "single":
        return SingleServer(model_path, host=args.host, extra_args=extra, log_dir=args.log_dir, port=args.port, **gpu)
    return PDDeployment(model_path, host=args.host, extra_args=extra, log_dir=args.log_dir,
                        transfer_backend=args.transfer_backend, router_port=args.port,
                        prefills=args.prefill, decodes=args.decode, **gpu)


def _dry_run(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    """Print every server's command line (with its GPUs; on loopback, without the link) and exit."""
    deployment = _deployment(args, str(args.model_path or f"<the prepared {args.model}>"), extra)
    try:
        procs = deployment.server_processes()
    except GpuPlacementError as exc:
        parser.error(str(exc))
    for proc in procs:
        print(f"[lynx] {proc.name}: {' '.join(proc.argv)}")
    return 0


def _run(args: argparse.Namespace, model_path: str, extra: list[str], link: Link) -> int:
    deployment = _deployment(args, model_path, extra)
    if isinstance(deployment, PDDeployment):
        place_on_link(deployment, link)
    try:
        with deployment:
            try:
                waited = deployment.start(timeout_s=args.timeout, progress=True)
            except KeyboardInterrupt:
                print("\n[lynx] interrupted during start-up; stopping", flush=True)
                return 130
            print(f"[lynx] {args.command} deployment healthy after {waited:.0f} s", flush=True)
            return _serve_forever(deployment)
    except (ServerStartError, GpuPlacementError) as exc:
        print(f"[lynx] start-up failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
