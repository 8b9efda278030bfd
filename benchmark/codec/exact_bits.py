"""Bits per value of every mode's streams, with ``lynx-exact``'s exact stream measured on real KV.

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/exact_bits.py --tokens 1024 4096 8192

Per prompt length: one local-text prompt (``local_texts.build_contexts``, seed 0) through the default
model in bf16 (transformers, as a bf16 KV pool holds it: post-RoPE K and V of all 30 layers). Every
layer's K and V is encoded with ``lynx`` (the CPU fast path when built, else the reference: the bytes
are identical), then the exact stream is encoded, decoded and checked bit for bit against the
prompt's KV, per layer and as one request streamed in ``--chunk-tokens`` chunks sends it. Two
implementations of the exact stream, byte-identical (checked here too): the C fast path
(``kernels/lynx_exact_cpu``, every length) and the torch reference (``codec/lynx_exact``, at the lengths
of ``--reference-tokens``: it is slow). Fixed-size modes take their bits from the layout
table (``layout.wire_bits_per_value``: what goes on the wire, so ``lynx``'s residual without the bytes
its anchor's trailer carries); ``lynx-exact`` = ``lynx``'s anchor and residual + the measured
exact stream. Throughput: exact-stream encode (from the original KV and its lynx encoding) and
decode (from the lynx streams and the exact stream to BF16), in MB/s of BF16 KV, against a memory
copy of a buffer of the request's KV size (``Tensor.copy_``, best of 5) in the same run.

Writes ``benchmark/codec/results/bits_per_stream.json`` and the ``exact-bits`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parents[1]))

from benchmark.pd_modes import default_model_path  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402
from local_texts import build_contexts  # noqa: E402
from results_md import replace_section  # noqa: E402

from sglang_lynx.codec import lynx_exact  # noqa: E402
from sglang_lynx.codec.layout import LayoutParams, wire_bits_per_value  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402
from sglang_lynx.config import MODES  # noqa: E402

TARGET_EXACT_BITS, TARGET_TOTAL_BITS = 3.0, 12.0
TARGET_ENCODE_SHARE, TARGET_DECODE_SHARE = 0.05, 0.10


def capture_kv(model_dir: str, tokens: int, seed: int) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(source file, per layer (K, V) as [T, H, D] bf16) of one local-text prompt, bf16 forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    path, ids = build_contexts(tok, 1, tokens, seed=seed)[0]
    with torch.no_grad():
        cache = DynamicCache()
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    kv = [(layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
          for layer in cache.layers]  # fmt: skip
    return path, kv


def lynx_encode(codec: Any, x: torch.Tensor, kind: str, layer: int) -> Any:
    try:
        from sglang_lynx.kernels import lynx_cpu_fast

        return lynx_cpu_fast.encode(x, kind, params=codec.params, layer=layer)  # type: ignore[arg-type]
    except (ImportError, RuntimeError):
        return codec.encode(x, kind, layer=layer)


def memcpy_mb_s(nbytes: int, repeats: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e6


def implementations(reference: bool) -> dict[str, Any]:
    from sglang_lynx.kernels import lynx_exact_cpu

    lynx_exact_cpu.build()
    return {"fast": lynx_exact_cpu, **({"reference": lynx_exact} if reference else {})}


def measure(kv: list[tuple[torch.Tensor, torch.Tensor]], params: LayoutParams, reference: bool,
            chunk_tokens: int) -> dict[str, Any]:
    codec = get_codec("lynx", **vars(params))
    impls = implementations(reference)
    times = {name: [0.0, 0.0] for name in impls}
    exact_bytes = {"k": 0, "v": 0}
    values = {"k": 0, "v": 0}
    frames = [0] * lynx_exact.NUM_FRAMES
    escapes = 0
    encoded = []
    for layer, pair in enumerate(kv):
        encoded.append(tuple(lynx_encode(codec, x, kind, layer) for kind, x in zip(("k", "v"), pair, strict=True)))
        for kind, x, enc in zip(("k", "v"), pair, encoded[-1], strict=True):
            streams = []
            for name, impl in impls.items():
                start = time.perf_counter()
                exact = impl.encode_exact(x, enc, params)
                middle = time.perf_counter()
                back = impl.decode_exact(enc, exact, params)
                times[name][1] += time.perf_counter() - middle
                times[name][0] += middle - start
                if not torch.equal(back.view(torch.int16), x.view(torch.int16)):
                    raise AssertionError(f"layer {layer} {kind} ({name}): the KV was not restored bit for bit")
                streams.append(exact)
            if any(other != streams[0] for other in streams):
                raise AssertionError(f"layer {layer} {kind}: the implementations' exact streams differ")
            header = lynx_exact.HEADER.unpack_from(exact)
            escapes += header[1]
            frames = [a + b for a, b in zip(frames, header[2:], strict=True)]
            exact_bytes[kind] += len(exact)
            values[kind] += x.numel()
    total_values = values["k"] + values["v"]
    kv_bytes = 2 * total_values
    memcpy = memcpy_mb_s(kv_bytes)
    classes = [f"{lynx_exact.RANK_CLASSES[i].lo}-{lynx_exact.RANK_CLASSES[i].hi}" + (f" plane {p}" if p else "")
               for i, p in lynx_exact.FRAMES]  # fmt: skip
    return {
        "streamed": measure_streamed(kv, encoded, params, chunk_tokens),
        "exact_bits": 8 * (exact_bytes["k"] + exact_bytes["v"]) / total_values,
        "exact_bits_k": 8 * exact_bytes["k"] / values["k"],
        "exact_bits_v": 8 * exact_bytes["v"] / values["v"],
        "exact_bits_by_rank_class": {c: 8 * b / total_values for c, b in zip(classes, frames, strict=True)},
        "escapes": escapes,
        "values": total_values,
        "encode_mb_s": kv_bytes / times["fast"][0] / 1e6,
        "decode_mb_s": kv_bytes / times["fast"][1] / 1e6,
        "memcpy_mb_s": memcpy,
        "by_implementation": {name: {"encode_mb_s": kv_bytes / t[0] / 1e6, "decode_mb_s": kv_bytes / t[1] / 1e6}
                              for name, t in times.items()},
    }


def streamed_runs(tokens: int, page: int, chunk_tokens: int) -> list[list[tuple[int, int]]]:
    """The page runs a layered prefill of ``chunk_tokens``-token chunks writes for each layer: each chunk's
    full pages but the page of the request's last token, then the rest with the last part."""
    pages, done, runs = -(-tokens // page), 0, []
    for end in range(chunk_tokens, tokens + chunk_tokens, chunk_tokens):
        full = min(end, tokens - 1) // page
        if full > done:
            runs.append([(done, full)])
            done = full
    return [*runs, [(done, pages)]] if done < pages else runs


def measure_streamed(kv: list[tuple[torch.Tensor, torch.Tensor]], encoded: list[tuple[Any, Any]],
                     params: LayoutParams, chunk_tokens: int) -> dict[str, Any]:
    """The request's exact stream as a layered prefill of ``chunk_tokens``-token chunks sends it (one piece
    per layer K / V per part, ``codec.exact_request``), decoded bit-exact: its bits per value."""
    from sglang_lynx.codec.exact_request import (
        ExactRequestWriter,
        decode_exact_request_into,
        exact_request_capacity,
        parse_exact_request,
    )

    codec = get_codec("lynx-exact", **vars(params))
    layers, (tokens, heads, dim) = len(kv), tuple(kv[0][0].shape)
    anchor = torch.cat([enc.anchor.reshape(-1) for kind in (0, 1) for enc in (pair[kind] for pair in encoded)])
    residual = torch.cat([enc.residual.reshape(-1) for kind in (0, 1) for enc in (pair[kind] for pair in encoded)])
    out = torch.empty(exact_request_capacity(layers, tokens, heads, dim, params.page_tokens), dtype=torch.uint8)
    from sglang_lynx.kernels import lynx_exact_cpu

    writer = ExactRequestWriter(codec, layers, tokens, heads, dim, out, lynx_exact_cpu)
    ks, vs = [k for k, _ in kv], [v for _, v in kv]
    parts = streamed_runs(tokens, params.page_tokens, chunk_tokens)
    for i, part in enumerate(parts):
        for first, end in part:
            writer.write(ks, vs, anchor, residual, [(layer, first, end) for layer in range(layers)],
                         last=i == len(parts) - 1)
    stream = out[: writer.length].numpy().tobytes()
    pool = [torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
    decode_exact_request_into(anchor, residual, stream, pool[:layers], pool[layers:], torch.arange(tokens),
                              codec=codec, impl=lynx_exact_cpu)
    if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pool, ks + vs, strict=True)):
        raise AssertionError("the streamed request's exact stream did not restore the KV bit for bit")
    return {"chunk_tokens": chunk_tokens, "parts": len(parts), "bytes": len(stream),
            "pieces": len(parse_exact_request(stream, layers, -(-tokens // params.page_tokens))),
            "exact_bits": 8 * len(stream) / (2 * layers * tokens * heads * dim)}


def mode_rows(tokens: int, heads: int, dim: int, params: LayoutParams, exact_bits: float) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        anchor, residual = (16.0, 0.0) if mode == "bf16" else wire_bits_per_value(mode, tokens, heads, dim, params)
        exact = exact_bits if mode == "lynx-exact" else 0.0
        rows.append({"mode": mode, "tokens": tokens, "anchor": anchor, "residual": residual, "exact": exact,
                     "total": anchor + residual + exact, "exact_measured": mode == "lynx-exact"})  # fmt: skip
    return rows


def markdown(result: dict[str, Any]) -> str:
    prov = result["provenance"]
    lines = [
        "## Bits per value of every stream, lynx-exact's exact stream measured (exact_bits.py)",
        "",
        f"Command: `{prov.get('command', 'unknown')}`; commit {prov.get('commit', 'unknown')}; machine: "
        f"{prov['machine'].get('cpu', 'unknown')}, load average {prov['machine'].get('loadavg')} (shared). "
        "Real KV of the default model (bf16 forward, all layers, K and V, one local-text prompt per length); "
        "the exact stream decoded bit-exact on every layer. Bits per value on the wire (lynx's residual "
        "leaves out the last 48 tokens' nibbles, which its anchor's trailer carries).",
        "",
        "| mode | tokens | anchor | residual | exact | total |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        exact = f"**{row['exact']:.3f}** (measured)" if row["exact_measured"] else "-"
        lines.append(f"| {row['mode']} | {row['tokens']} | {row['anchor']:.3f} | {row['residual']:.3f} | {exact} | "
                     f"{row['total']:.3f} |")  # fmt: skip
    lines += ["", "Throughput of the C fast path in this run's one pass over the layers (one thread, first calls "
              "included, the reference's between them; `throughput.py --exact-tokens` times medians of repeats "
              "for the targets; the torch reference where measured: "
              + "; ".join(f"{t}: encode {m['by_implementation']['reference']['encode_mb_s']:.2f} MB/s, decode "
                          f"{m['by_implementation']['reference']['decode_mb_s']:.2f} MB/s"
                          for t, m in result["exact"].items() if "reference" in m["by_implementation"]) + "):"]
    lines += ["", "| tokens | exact K | exact V | escapes | encode MB/s | decode MB/s | memcpy MB/s | "
              "encode / memcpy | decode / memcpy |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tokens, m in result["exact"].items():
        lines.append(f"| {tokens} | {m['exact_bits_k']:.3f} | {m['exact_bits_v']:.3f} | {m['escapes']} | "
                     f"{m['encode_mb_s']:.2f} | {m['decode_mb_s']:.2f} | {m['memcpy_mb_s']:.0f} | "
                     f"{m['encode_mb_s'] / m['memcpy_mb_s']:.2%} | "
                     f"{m['decode_mb_s'] / m['memcpy_mb_s']:.2%} |")  # fmt: skip
    lines += ["", "The exact stream as a request streamed during its prefill sends it (one piece per layer K / V per "
              "part: each chunk's full pages, then the rest; `codec.exact_request`), decoded bit-exact:", "",
              "| tokens | chunk | parts | pieces | bits/value | per layer whole | cost of the split |",
              "|---|---|---|---|---|---|---|"]
    for tokens, m in result["exact"].items():
        if "streamed" in m:
            st = m["streamed"]
            lines.append(f"| {tokens} | {st['chunk_tokens']} | {st['parts']} | {st['pieces']} | "
                         f"{st['exact_bits']:.3f} | {m['exact_bits']:.3f} | "
                         f"{st['exact_bits'] - m['exact_bits']:+.3f} |")  # fmt: skip
    lines += ["", "Targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in result["targets"].items())]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference-tokens", type=int, nargs="*", default=[1024],
                    help="lengths at which the (slow) torch reference is also timed and compared")
    ap.add_argument("--chunk-tokens", type=int, default=4096,
                    help="the prefill chunk of the streamed request's exact stream (SGLang's chunked prefill)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bits_per_stream.json")
    ap.add_argument("--markdown", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args()
    params = LayoutParams()
    model_dir = default_model_path()
    rows: list[dict[str, Any]] = []
    exact: dict[str, Any] = {}
    for tokens in args.tokens:
        path, kv = capture_kv(model_dir, tokens, args.seed)
        m = measure(kv, params, tokens in args.reference_tokens, args.chunk_tokens)
        m["source"] = path
        exact[str(tokens)] = m
        heads, dim = int(kv[0][0].shape[1]), int(kv[0][0].shape[2])
        rows += mode_rows(tokens, heads, dim, params, m["exact_bits"])
        print(f"{tokens} tokens: exact {m['exact_bits']:.3f} bits/value, encode {m['encode_mb_s']:.2f} MB/s, "
              f"decode {m['decode_mb_s']:.2f} MB/s, memcpy {m['memcpy_mb_s']:.0f} MB/s", flush=True)  # fmt: skip
    totals = [r["total"] for r in rows if r["mode"] == "lynx-exact"]
    targets = {
        f"exact <= {TARGET_EXACT_BITS} bits/value": all(m["exact_bits"] <= TARGET_EXACT_BITS for m in exact.values()),
        f"total <= {TARGET_TOTAL_BITS} bits/value": all(t <= TARGET_TOTAL_BITS for t in totals),
        f"encode >= {TARGET_ENCODE_SHARE:.0%} of memcpy": all(
            m["encode_mb_s"] >= TARGET_ENCODE_SHARE * m["memcpy_mb_s"] for m in exact.values()),
        f"decode >= {TARGET_DECODE_SHARE:.0%} of memcpy": all(
            m["decode_mb_s"] >= TARGET_DECODE_SHARE * m["memcpy_mb_s"] for m in exact.values()),
    }  # fmt: skip
    result = {"provenance": provenance(), "rows": rows, "exact": exact, "targets": targets,
              "zstd_level": lynx_exact.ZSTD_LEVEL,
              "implementation": "encode/decode_mb_s: C fast path (kernels/lynx_exact_cpu), one thread; "
                                "by_implementation adds the torch reference where measured"}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    replace_section(args.markdown, "exact-bits", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
