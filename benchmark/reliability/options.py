"""The soak's command line (defaults: a 5-minute run; BENCHMARKS.md names the 30-minute one)."""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Load soak of a PD deployment in mode lynx.")
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
    p.add_argument("--restart-prefill-at-s", type=float, default=None, help="kill and restart the prefill then")
    p.add_argument("--restart-timeout-s", type=float, default=600.0)
    p.add_argument("--router-circuit-breaker", action="store_true",
                   help="keep sglang_router's circuit breaker (default: off, see restart.py)")
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="of each server's sampled span")
    p.add_argument("--rss-tolerance", type=float, default=0.02, help="end RSS over the warm-up RSS, relative")
    p.add_argument("--count-tolerance", type=int, default=2, help="end sockets / threads over the warm-up")
    p.add_argument("--staging-mb", type=int, default=128,
                   help="each side's Lynx staging arena in MiB (send_arena_mb / receive_arena_mb)")
    p.add_argument("--lynx-config-json", default=None, help="a JSON object merged into the Lynx config")
    p.add_argument("--max-total-tokens", default="8192")
    p.add_argument("--context-length", type=int, default=None,
                   help="the servers' --context-length: small arenas must hold one max-context request "
                        "(the servers refuse to start otherwise; ~12.5 KiB per token in mode lynx)")
    p.add_argument("--min-available-gib", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a fresh temp dir)")
    return p.parse_args(argv)
