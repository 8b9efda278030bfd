"""The router's process entry for our launcher: ``python -m sglang_lynx.integration.platform.router_process
ARGS`` runs the same Rust router as ``python -m sglang_router.launch_router ARGS`` (the same
``RouterArgs`` parsing and validation, ``Router.from_args(...).start()``), without that module's
import of its Python mini load balancer, which imports ``sglang`` (measured 5 s on an idle 2-core
host and 15 s beside a running test tier, against 0.1 s for this module).

Only the Rust router is offered: ``--mini-lb`` (a debugging balancer) is refused with a message. SIGINT (the
launcher's first stop signal) ends it with a one-line message and exit status 0.
``launch.deployment.PDDeployment`` starts its router with this entry; users' own launch lines keep
``sglang_router.launch_router``, which takes the same flags.
"""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str]) -> object:
    """``argv`` parsed as ``sglang_router.launch_router`` parses it (``RouterArgs``)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="sglang_lynx.integration.platform.router_process",
                                     description="sglang_router's Rust router (flags as sglang_router.launch_router)")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb: this entry runs only the Rust router; use python -m sglang_router.launch_router")
    args._validate_router_args()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    import setproctitle
    from sglang_router.router import Router

    setproctitle.setproctitle("sglang::router")
    try:
        Router.from_args(args).start()
    except KeyboardInterrupt:  # the launcher stops it with SIGINT first: a clean stop, not a traceback in its log
        print("router: stopped (SIGINT)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
