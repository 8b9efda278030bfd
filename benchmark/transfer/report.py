"""Render bench_streams.py results (results.json) as benchmark/transfer/RESULTS.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_markdown(runs: list[dict[str, Any]], path: Path) -> None:
    lines = ["# Transfer layer: raw Mooncake vs the two-priority scheduler", ""]
    for results in runs:
        lines += run_section(results)
    path.write_text("\n".join(lines) + "\n")


def run_section(results: dict[str, Any]) -> list[str]:
    rows = [r for r in results["rows"] if "ctx" in r]
    ovl = [r for r in results["rows"] if "overlap_ctx" in r]
    lines = [
        f"## Run: residual chunks {results.get('residual_chunk_kib', 4096)} KiB, window "
        f"{results.get('residual_window', 2)}",
        "",
        f"- Machine: {results['machine']} (shared with other developers, no GPU)",
        f"- Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmark/transfer/{results['command']}`",
        f"- Link emulation: {results['emulation']}",
        f"- zlib crc32 throughput on this machine: {results['crc32_GBps']:.2f} GB/s",
        "- Sizes: default model, 23,040 B bf16 KV per token; anchor 5/16, residual 4/16 of that.",
        "- raw = anchor + residual as two plain Mooncake writes; sched wire = first chunk issued -> residual "
        "landed (4 MiB chunks, window 2); sched e2e adds the crc32 framing done in the encode stage; "
        "overhead vs raw. Median of the repeats.",
        "- backlog anchor = an anchor submitted while 3 other requests' residuals flow: queued -> landed, "
        "against the ideal anchor bytes / link rate (target <= 1.10x).",
        "",
        "| link Gb/s | ctx | raw ms | sched wire ms | sched e2e ms | overhead wire | overhead e2e | "
        "raw Gb/s achieved | backlog anchor ms | ideal ms | ratio | ratio vs achieved raw rate "
        "| backlog after anchor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['link_gbps']:g} | {r['ctx']} | {r['raw_s'] * 1e3:.1f} | {r['sched_wire_s'] * 1e3:.1f} | "
            f"{r['sched_e2e_s'] * 1e3:.1f} | {r['overhead_wire']:+.1%} | {r['overhead_e2e']:+.1%} | "
            f"{r['raw_gbps']:.2f} | {r['backlog_anchor_s'] * 1e3:.1f} | {r['ideal_anchor_s'] * 1e3:.1f} | "
            f"{r['backlog_anchor_vs_ideal']:.2f}x | "
            f"{r['backlog_anchor_s'] * r['raw_gbps'] * 1e9 / (r['anchor_bytes'] * 8):.2f}x | "
            f"{'yes' if r['bulk_residual_landed_after_anchor'] else 'no'} |")
    lines += [
        "",
        "### Encode overlap (stand-in encoder: torch affine 8-bit quantization of bf16 KV, not the Lynx codec)",
        "",
        "| link Gb/s | ctx | objects | encode s | wire s | serial s | pipelined s | hidden s | hidden / encode "
        "| hidden / max hideable |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ovl:
        lines.append(
            f"| {r['link_gbps']:g} | {r['overlap_ctx']} | {r['objects']} | {r['encode_s']:.3f} | "
            f"{r['wire_s']:.3f} | {r['serial_s']:.3f} | {r['pipelined_s']:.3f} | {r['hidden_s']:.3f} | "
            f"{r['hidden_share_of_encode']:.0%} | {r['hidden_vs_max_hideable']:.0%} |")
    return lines + [""]
