"""The ``lynx-exact`` stream as the servers code it, on one thread and on ``exact_threads`` pooled ones.

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/exact_request_threads.py --tokens 1024 4096 8192 --threads 1 2

What the servers run (``integration/transport/codec.py``: ``exact_stream_writer``, ``decode_exact_streams``,
``exact_piece_runner``), on real KV of the default model (``exact_throughput.real_kv``: one local-text prompt,
post-RoPE K and V of all 30 layers; ``--kv-cache DIR`` keeps them):

- ``encode per layer``: the layered prefill's writes, one ``ExactRequestWriter.write`` per layer (its K and V
  pieces, every page: ``stream_layer_group`` 1 with the last page sent with its group);
- ``encode whole``: one ``write_whole`` (every layer's K and V pieces in one call: a buffered request);
- ``restore (reader)``: ``ExactRequestReader.finish`` into the request's own BF16 tensors, every piece at
  once (what the decode's ``ExactPrefetch`` runs, there piece by piece while the streams land);
- ``decode whole``: ``decode_exact_request_into`` into a BF16 pool by slot (the decode's path for a request
  the prefetch budget left out, once every stream landed).

Each on the process's C fast path (``exact_layer_codec``) with the piece runner of ``exact_threads`` = N, the
bytes and the pool checked equal to one thread's. MB/s are bytes of BF16 KV per second, medians of
``--repeats``, beside ``Tensor.copy_`` of as many bytes (one thread). Writes
``results/exact_request_threads.json`` (command, commit, machine, load average per length).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parents[1]))

from benchmark.provenance import provenance  # noqa: E402
from benchmark.timing import median_seconds  # noqa: E402
from exact_throughput import copy_mb_s, real_kv  # noqa: E402

from sglang_lynx.codec.exact_request import decode_exact_request_into, exact_request_capacity  # noqa: E402
from sglang_lynx.codec.exact_request_reader import ExactRequestReader  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402
from sglang_lynx.codec.request import encode_request  # noqa: E402
from sglang_lynx.config import LynxConfig  # noqa: E402
from sglang_lynx.integration.transport.codec import (  # noqa: E402
    exact_layer_codec,
    exact_piece_runner,
    exact_stream_writer,
)

RUNS = ("encode per layer", "encode whole", "restore (reader)", "decode whole")


def measure_length(tokens: int, threads: list[int], repeats: int, seed: int, cache: Path | None) -> dict[str, Any]:
    source, kv = real_kv(tokens, seed, cache)
    ks, vs = [k.contiguous() for k, _ in kv], [v.contiguous() for _, v in kv]
    nbytes = 2 * sum(k.numel() + v.numel() for k, v in zip(ks, vs, strict=True))
    out: dict[str, Any] = {"tokens": int(ks[0].shape[0]), "source": source, "kv_bytes": nbytes,
                           "codec_path": exact_layer_codec().__name__, "memcpy_mb_s": copy_mb_s(nbytes), "runs": {}}
    load, reference = [os.getloadavg()[0]], None
    for n in threads:
        request = ServedRequest(ks, vs, LynxConfig(mode="lynx-exact", exact_threads=n))
        got = request.check()
        if reference is not None and got != reference:
            raise AssertionError(f"{tokens} tokens: {n} threads wrote other bytes than {threads[0]}")
        reference = got
        fns = (request.encode_per_layer, request.encode_whole, request.restore, request.decode_whole)
        for name, fn in zip(RUNS, fns, strict=True):
            seconds = median_seconds(fn, repeats)
            mb_s = nbytes / seconds / 1e6
            out["runs"][f"{name}, {n} thread(s)"] = {"run": name, "threads": n, "mb_s": mb_s, "ms": 1e3 * seconds,
                                                     "share_of_memcpy": mb_s / out["memcpy_mb_s"]}  # fmt: skip
        load.append(os.getloadavg()[0])
    assert reference is not None
    out["exact_bits_per_value"] = 8 * len(reference[0]) / (nbytes // 2)
    out["loadavg_1min"] = load
    return out


class ServedRequest:
    """One request's KV and its lynx streams, coded as the servers code them with ``config.exact_threads``."""

    def __init__(self, ks: list[torch.Tensor], vs: list[torch.Tensor], config: LynxConfig) -> None:
        self.ks, self.vs, self.config = ks, vs, config
        self.codec = get_codec("lynx-exact")
        self.payload = encode_request(ks, vs, self.codec)
        self.layers, (self.tokens, self.heads, self.dim) = len(ks), ks[0].shape
        self.pages = -(-self.tokens // self.codec.params.page_tokens)
        capacity = exact_request_capacity(self.layers, self.tokens, self.heads, self.dim,
                                          self.codec.params.page_tokens)  # fmt: skip
        self.buf = torch.empty(capacity, dtype=torch.uint8)
        self.k_pool, self.v_pool = [torch.empty_like(k) for k in ks], [torch.empty_like(v) for v in vs]
        self.k_out, self.v_out = [torch.empty_like(k) for k in ks], [torch.empty_like(v) for v in vs]
        self.stream = b""
        self.run_pieces = exact_piece_runner(config)

    def _writer(self) -> Any:
        return exact_stream_writer(self.codec, self.layers, self.tokens, self.heads, self.dim, self.buf, self.config)

    def encode_per_layer(self) -> int:
        writer, a, r = self._writer(), self.payload.anchor, self.payload.residual
        for layer in range(self.layers):
            writer.write(self.ks, self.vs, a, r, [(layer, 0, self.pages)], last=layer == self.layers - 1)
        return int(writer.length)

    def encode_whole(self) -> int:
        writer = self._writer()
        writer.write_whole(self.ks, self.vs, self.payload.anchor, self.payload.residual)
        return int(writer.length)

    def decode_whole(self) -> None:
        decode_exact_request_into(self.payload.anchor, self.payload.residual, self.stream, self.k_pool, self.v_pool,
                                  torch.arange(self.tokens, dtype=torch.int64), codec=self.codec,
                                  impl=exact_layer_codec(), run_pieces=self.run_pieces)  # fmt: skip

    def restore(self) -> None:
        reader = ExactRequestReader(self.codec, self.layers, self.tokens, self.heads, self.dim, 0, exact_layer_codec(),
                                    self.run_pieces)  # fmt: skip
        reader.finish(self.stream, self.payload.anchor, self.payload.residual, self.k_out, self.v_out)

    def check(self) -> tuple[bytes, bytes]:
        """Both encodes' bytes (the decode's input set to the whole one), the decode checked bit for bit."""
        layered = self.buf[: self.encode_per_layer()].numpy().tobytes()
        self.stream = self.buf[: self.encode_whole()].numpy().tobytes()
        self.decode_whole()
        self.restore()
        for got, want in zip(self.k_pool + self.v_pool + self.k_out + self.v_out, 2 * (self.ks + self.vs), strict=True):
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"{self.config.exact_threads} threads: the pool is not the KV bit for bit")
        return self.stream, layered


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| tokens | run | threads | ms | MB/s | % of memory copy |", "|---|---|---|---|---|---|"]
    for row in rows:
        for run in row["runs"].values():
            lines.append(f"| {row['tokens']} | {run['run']} | {run['threads']} | {run['ms']:.1f} | {run['mb_s']:.0f} "
                         f"| {100 * run['share_of_memcpy']:.2f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="the local-text prompt of the real KV")
    parser.add_argument("--kv-cache", type=Path, default=None, help="keep the captured real KV here between runs")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "exact_request_threads.json")
    args = parser.parse_args()
    rows = [measure_length(t, args.threads, args.repeats, args.seed, args.kv_cache) for t in args.tokens]
    table = markdown(rows)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
