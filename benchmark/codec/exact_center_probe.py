"""What a cheaper exact stream would cost in bits: the rank in the bin (today) against the offset from the bin's
centre (no bin search), on real KV of the default model.

One command::

    OMP_NUM_THREADS=1 python benchmark/codec/exact_center_probe.py --tokens 1024 4096

Why: the exact stream's C path spends most of its time finding every value's bin (``kernels/lynx_exact_cpu``:
an estimate in double, a division-free threshold and three probes per boundary, two boundaries per value),
which keeps it at ~2% of memory-copy bandwidth. A stream that carried ``ordinal(x) - centre`` instead, with
``centre`` the nearest BF16 to the dequantised code ``mn + rng c / 225`` and the rank class replaced by a
*width class* computed from the group's range and the centre's exponent alone, would need one estimate per
value and no search. This probe measures what that costs, per layer K and V of one prompt (all 30 layers,
the sink excluded as in the stream):

- ``rank_entropy``: the order-0 entropy of today's ranks given their rank class (``lynx_exact.RANK_CLASSES``),
  beside ``stream_bits``, today's exact stream as sent (C path, zstd): how close zstd comes to the entropy;
- ``offset_entropy[g]``: the entropy of the centre offsets given a width class of ``g`` classes per octave of
  ``(rng / 225) / ulp(centre)`` (the bin's estimated width in BF16 ordinals);
- ``offset_zstd_bits[g]``: those offsets coded as a stream would code them: zigzag, packed per class into
  1 / 2 / 4 / 8 / 16 bits as today's ranks, each plane one zstd frame at today's level.

Nothing here is a format: it is the measurement a format decision needs. Writes
``benchmark/codec/results/exact_center_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE.parents[1]))

from benchmark.codec.exact_bits import capture_kv, lynx_encode  # noqa: E402
from benchmark.pd_modes import default_model_path  # noqa: E402
from benchmark.provenance import provenance  # noqa: E402

from sglang_lynx.codec import exact_bins, lynx_exact  # noqa: E402
from sglang_lynx.codec.registry import get_codec  # noqa: E402

GRANULARITIES = (1, 2, 4)  # width classes per octave


def conditional_entropy_bits(symbols: torch.Tensor, classes: torch.Tensor) -> float:
    """Total order-0 bits of ``symbols`` coded per class (sum over classes of count x entropy)."""
    total = 0.0
    for c in classes.unique():
        _, counts = symbols[classes == c].unique(return_counts=True)
        p = counts.double() / counts.sum()
        total += float(-(counts.double() * p.log2()).sum())
    return total


def zstd_bits(symbols: torch.Tensor, classes: torch.Tensor) -> int:
    """Bits of ``symbols`` (int) as a stream would carry them: zigzagged, packed per class into the fewest of 1,
    2, 4, 8 or 16 bits that hold the class's largest, exactly as ``lynx_exact`` packs ranks (its ``_pack``), one
    zstd frame per plane."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=lynx_exact.ZSTD_LEVEL)
    zig = torch.where(symbols >= 0, 2 * symbols, -2 * symbols - 1).to(torch.int32)
    total = 0
    for c in classes.unique():
        z = zig[classes == c]
        bits = next(b for b in (1, 2, 4, 8, 16) if int(z.max()) < (1 << b))
        total += sum(8 * len(compressor.compress(plane)) for plane in lynx_exact._pack(z, bits))
    return total


def width_class(centre: torch.Tensor, rng: torch.Tensor, per_octave: int) -> torch.Tensor:
    """floor(per_octave x log2 of the bin's estimated width in BF16 ordinals), from the range and the centre's
    exponent only (BF16: 8 significant bits; the subnormal spacing below 2^-126)."""
    exponent = torch.floor(torch.log2(centre.abs().clamp_min(2.0**-126)))
    width = (rng.double() / 225.0) / torch.exp2(exponent - 7)
    return torch.floor(per_octave * torch.log2(width.clamp_min(2.0**-4))).to(torch.int64)


def measure_layer(x: torch.Tensor, enc: Any, params: Any, kind: str) -> dict[str, float]:
    mn, rng, code = exact_bins.value_fields(enc.anchor, enc.residual, *x.shape, kind, params)
    first, count = exact_bins.bins(code, mn, rng)
    sink = min(params.sink_tokens, x.shape[0]) * x.shape[1] * x.shape[2]
    ords = exact_bins.bf16_ordinals(x).reshape(-1)[sink:]
    first, count = first.reshape(-1)[sink:], count.reshape(-1)[sink:]
    rank_class = torch.zeros_like(count)
    for i, rc in enumerate(lynx_exact.RANK_CLASSES):
        rank_class[(count >= rc.lo) & (count <= rc.hi)] = i + 1
    coded = rank_class > 0  # one-value bins carry nothing today
    centre_value = (mn.double() + rng.double() * (code.double() / 225.0)).reshape(-1)[sink:]
    centre = exact_bins.bf16_ordinals(centre_value.float().clamp(-3.0e38, 3.0e38).to(torch.bfloat16))
    offset = ords - centre
    out = {"values": float(ords.numel()),
           "rank_bits": conditional_entropy_bits((ords - first)[coded], rank_class[coded])}  # fmt: skip
    for g in GRANULARITIES:
        cls = width_class(centre_value, rng.reshape(-1)[sink:], g)
        out[f"offset_bits_{g}"] = conditional_entropy_bits(offset, cls)
        out[f"offset_zstd_bits_{g}"] = float(zstd_bits(offset, cls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "exact_center_probe.json")
    args = ap.parse_args()
    codec = get_codec("lynx")
    try:
        from sglang_lynx.kernels import lynx_exact_cpu as exact_impl
    except ImportError:
        exact_impl = lynx_exact  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for tokens in args.tokens:
        path, kv = capture_kv(default_model_path(), tokens, args.seed)
        sums: dict[str, float] = {}
        stream_bytes = 0
        for layer, pair in enumerate(kv):
            for kind, x in zip(("k", "v"), pair, strict=True):
                enc = lynx_encode(codec, x, kind, layer)
                for key, value in measure_layer(x, enc, codec.params, kind).items():
                    sums[key] = sums.get(key, 0.0) + value
                stream_bytes += len(exact_impl.encode_exact(x, enc, codec.params))
        values = sums.pop("values")
        row = {"source": path, "values": int(values), "stream_bits": 8 * stream_bytes / values,
               "rank_entropy": sums["rank_bits"] / values}  # fmt: skip
        for g in GRANULARITIES:
            row[f"offset_entropy_{g}_per_octave"] = sums[f"offset_bits_{g}"] / values
            row[f"offset_zstd_bits_{g}_per_octave"] = sums[f"offset_zstd_bits_{g}"] / values
        results[str(tokens)] = row
        print(f"{tokens} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)),
              flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
