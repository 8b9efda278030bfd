"""``python -m sglang_lynx.launch {pd,single,demo} [options] [-- extra SGLang flags]``.

pd      start prefill + decode (Mooncake) + router on loopback, print the endpoint, serve until Ctrl-C
        (``--prefill N --decode M``: N prefill and M decode servers behind the one router; default 1 and 1)
single  start one ordinary SGLang server
demo    start the PD deployment, send one real long-context request, print the answer and timings,
        shut everything down

Flags after ``--`` go to every SGLang server (for example ``-- --lynx --lynx-config lynx-int8``).
On a CUDA host each server gets its own GPUs (``--base-gpu-id``: the first one; ``--mem-fraction``:
every server's ``--mem-fraction-static``; see ``launch/gpus.py``); ``--dry-run`` prints the commands.
Everything stops cleanly on Ctrl-C or when any one process dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from sglang_lynx.launch.client import long_context_demo
from sglang_lynx.launch.deployment import PDDeployment, SingleServer, default_transfer_backend
from sglang_lynx.launch.gpus import GpuPlacementError
from sglang_lynx.launch.processes import ServerStartError
from sglang_lynx.models.catalog import DEFAULT_MODEL, MODELS


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
    parser.add_argument("--context-tokens", type=int, default=2048, help="demo: size of the long context")
    parser.add_argument("--base-gpu-id", type=int, default=0,
                        help="CUDA hosts: the first GPU; server i gets GPUs base + i*tp .. (default 0)")
    parser.add_argument("--mem-fraction", type=float, default=None,
                        help="CUDA hosts: --mem-fraction-static of every server (default: SGLang's; "
                             "servers sharing a GPU split 0.8 of it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every server's command line (with its GPUs) and exit")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="emulate a prefill->decode link of this rate for the Lynx streams "
                             "(application-level pacer in the prefill's transfer scheduler)")
    args = parser.parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        parser.error(f"--prefill and --decode must be >= 1 (got {args.prefill} and {args.decode})")
    if args.command == "single" and (args.prefill, args.decode) != (1, 1):
        parser.error("--prefill/--decode apply to pd and demo, not to single")

    # a dry run prepares nothing: it prints the command lines
    model_path = str(args.model_path or f"<the prepared {args.model}>") if args.dry_run else _resolve_model(args)
    if args.link_gbps is not None:
        os.environ["SGLANG_LYNX_LINK_GBPS"] = str(args.link_gbps)
        print(f"[lynx] link emulation: application pacer at {args.link_gbps} Gb/s (Lynx streams only)")
    deployment: PDDeployment | SingleServer
    gpu = dict(base_gpu_id=args.base_gpu_id, mem_fraction=args.mem_fraction)
    if args.command == "single":
        deployment = SingleServer(model_path, host=args.host, extra_args=extra, log_dir=args.log_dir, port=args.port,
                                  **gpu)
    else:
        deployment = PDDeployment(model_path, host=args.host, extra_args=extra, log_dir=args.log_dir,
                                  transfer_backend=args.transfer_backend, router_port=args.port,
                                  prefills=args.prefill, decodes=args.decode, **gpu)
    if args.dry_run:
        try:
            procs = deployment.server_processes()
        except GpuPlacementError as exc:
            parser.error(str(exc))
        for proc in procs:
            print(f"[lynx] {proc.name}: {' '.join(proc.argv)}")
        return 0

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)
    try:
        with deployment:
            try:
                waited = deployment.start(timeout_s=args.timeout, progress=True)
            except KeyboardInterrupt:
                print("\n[lynx] interrupted during start-up; stopping", flush=True)
                return 130
            print(f"[lynx] {args.command} deployment healthy after {waited:.0f} s", flush=True)
            if args.command == "demo":
                return long_context_demo(deployment.url, model_path, args.context_tokens)
            return _serve_forever(deployment)
    except (ServerStartError, GpuPlacementError) as exc:
        print(f"[lynx] start-up failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
