"""Encode time of one request with and without encoded-page reuse (the prefill's radix-cache hit).

One command::

    OMP_NUM_THREADS=1 .venv/bin/python benchmark/codec/page_reuse.py

For each context length and shared fraction: a first request is encoded with reuse (filling the
cache), then a second request whose first ``shared`` tokens (rounded down to whole pages) are the
first's, in the same KV slots, is encoded with reuse; its time is set against encoding it cold
(``encode_request_streams`` without reuse, the path every request took before). Input: the default
model's KV shape (30 layers, 3 KV heads, head dim 64, bf16; random with per-channel scales), the
``lynx`` codec, the transport's encode path (the C fast path where it applies). Best of ``--repeats``.
Writes ``results/page_reuse.json`` beside this file and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmark.model_shape import DEFAULT_KV  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402

from sglang_lynx.codec.page_cache import EncodedPageCache, prefix_page_hashes, slot_digests  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402
from sglang_lynx.config import LynxConfig  # noqa: E402
from sglang_lynx.integration.transport.codec import encode_request_streams  # noqa: E402
from sglang_lynx.integration.transport.page_cache import PageReuse  # noqa: E402

LAYERS, HEADS, HEAD_DIM = DEFAULT_KV.layers, DEFAULT_KV.kv_heads, DEFAULT_KV.head_dim


def _kv(tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.1, 6.0, HEAD_DIM)
    return [(torch.randn(tokens, HEADS, HEAD_DIM, generator=g) * scale).bfloat16() for _ in range(LAYERS)]


def _reuse(cache: EncodedPageCache, ids: list[int], slots: torch.Tensor, page: int) -> PageReuse:
    return PageReuse(cache, prefix_page_hashes(ids, page), slot_digests(slots, page), cache.epoch())


def measure(tokens: int, shared: float, repeats: int, config: LynxConfig) -> dict:
    codec = get_codec(config.codec_name, **config.codec_params())
    page = config.page_tokens
    keep = int(tokens * shared) // page * page
    k1, v1, k2, v2 = _kv(tokens, 1), _kv(tokens, 2), _kv(tokens, 3), _kv(tokens, 4)
    k2 = [torch.cat([a[:keep], b[keep:]]) for a, b in zip(k1, k2, strict=True)]
    v2 = [torch.cat([a[:keep], b[keep:]]) for a, b in zip(v1, v2, strict=True)]
    ids1 = list(range(tokens))
    ids2 = ids1[:keep] + list(range(10**6, 10**6 + tokens - keep))
    slots1 = torch.arange(tokens, dtype=torch.int64)
    slots2 = torch.cat([slots1[:keep], torch.arange(tokens, 2 * tokens - keep, dtype=torch.int64)])
    cold, warm, hits = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        want = encode_request_streams(k2, v2, codec, config)
        cold.append(time.perf_counter() - t0)
        cache = EncodedPageCache(1 << 30)
        encode_request_streams(k1, v1, codec, config, _reuse(cache, ids1, slots1, page))
        t0 = time.perf_counter()
        got = encode_request_streams(k2, v2, codec, config, _reuse(cache, ids2, slots2, page))
        warm.append(time.perf_counter() - t0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "reuse changed the bytes"
        hits = cache.hits
    return {"tokens": tokens, "shared_tokens": keep, "pages_reused": hits,
            "cold_s": min(cold), "reuse_s": min(warm), "speedup": min(cold) / min(warm)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--shared", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="lynx")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    config = LynxConfig(mode=args.mode)
    torch.set_num_threads(1)
    rows = [measure(t, s, args.repeats, config) for t in args.tokens for s in args.shared]
    print(f"| tokens | shared tokens | pages reused | cold encode s | with reuse s | speed-up |  ({args.mode})")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['shared_tokens']} | {r['pages_reused']} | {r['cold_s']:.3f} | "
              f"{r['reuse_s']:.3f} | {r['speedup']:.2f}x |")
    if not args.no_write:
        out = Path(__file__).resolve().parent / "results" / "page_reuse.json"
        out.write_text(json.dumps({"provenance": provenance(argv), "mode": args.mode, "rows": rows}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
