"""Markdown tables for each area's results file (pure: parsed JSON in, text out).

Each ``*_table(data)`` takes the content of one results file exactly as its benchmark wrote it and
returns a markdown table; ``TABLES`` maps an area key (sources.AREAS) to its renderer. A file that
lacks what a renderer needs raises ``ValueError`` naming the missing key, so the report says
which file is malformed instead of printing a half table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmark.accuracy.aggregate import AccuracyRow, AgreementRow, Record, accuracy_table, agreement_table
from benchmark.accuracy.summary import ModeSummary, identical_counts, mode_summaries
from benchmark.pd_modes import ALL_MODES
from benchmark.provenance import stamp
from benchmark.serving.serving_results import sweep_table


def _need(data: Any, key: str) -> Any:
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"results file has no '{key}'")
    return data[key]


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple):  # [mean, sd]
        return f"{value[0]:.{digits}f} +- {value[1]:.{digits}f}" if len(value) == 2 else str(value)
    return f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def codec_drafts_table(data: Any) -> str:
    meta = _need(data, "meta")
    rows = [[str(s["variant"]), _num(s.get("bits_per_value")), _num(s.get("accepted"), 1),
             _num(s.get("all_accepted")), _num(s.get("attn_err"), 4)] for s in _need(data, "summary")]
    head = (f"{meta.get('contexts', '?')} contexts of {meta.get('tokens', '?')} tokens, "
            f"{meta.get('draft', '?')} greedy draft tokens each\n\n")
    return head + _table(["draft KV", "bits/value", f"tokens kept of {meta.get('draft', '?')} (mean +- 95% CI)",
                          "all kept (share)", "attention-output rel. error (mean +- 95% CI)"], rows)


def codec_throughput_table(data: Any) -> str:
    rows = [[str(r["codec"]), str(r.get("kind", "-")), _num(r.get("encode_gbs"), 3), _num(r.get("decode_gbs"), 3)]
            for r in _need(data, "rows")]
    if any(r[0] != "memory copy" for r in rows):
        table = _table(["codec", "K/V", "encode GB/s", "decode GB/s"], rows)
    else:  # a run of the exact stream alone (``--codecs`` with no codec)
        table = "The torch reference codecs were not timed in this run.\n"
    if "exact" not in data:
        return table
    exact = []
    for tokens, m in data["exact"]["lengths"].items():
        runs = [(str(n), "" if n == 1 else f"_{n}t") for n in m.get("threads", [1])]
        if "encode_mb_s_2t_layers" in m:  # two threads, all layers in one call (lynx_exact_layers)
            runs.append(("2, layers at once", "_2t_layers"))
        for label, t in runs:
            load = f"{min(m['loadavg_1min']):.1f}-{max(m['loadavg_1min']):.1f}"
            copy = m.get(f"memcpy_mb_s{t}", m.get("memcpy_mb_s_2t"))
            exact.append([tokens, label, _num(m[f"encode_mb_s{t}"] / 1e3, 3),
                          f"{m[f'encode_share_of_memcpy{t}']:.2%}", _num(m[f"decode_mb_s{t}"] / 1e3, 3),
                          f"{m[f'decode_share_of_memcpy{t}']:.2%}", _num(copy / 1e3), load])
    return (table + "\nlynx-exact stream, C fast path, real KV of the default model (all layers, K and V), C workers "
            "(threads) against a copy by as many threads, wall-clock median of repeats:\n\n"
            + _table(["tokens", "threads", "encode GB/s", "encode / copy", "decode GB/s", "decode / copy", "copy GB/s",
                      "load"], exact))  # fmt: skip


def page_reuse_table(data: Any) -> str:
    rows = [[str(r["tokens"]), str(r["shared_tokens"]), str(r["pages_reused"]), _num(r["cold_s"], 3),
             _num(r["reuse_s"], 3), f"{r['speedup']:.2f}x"] for r in _need(data, "rows")]
    return _table(["tokens", "shared tokens", "pages reused", "encode, no reuse (s)", "encode with reuse (s)",
                   "speed-up"], rows)


def kernels_table(data: Any) -> str:
    rows = []
    for r in _need(data, "rows"):
        rows.append([str(r["path"]), str(r["tokens"]), str(r.get("layers", "-")), _num(r.get("copy_GBps")),
                     _num(r.get("encode_GBps"), 3), f"{r.get('encode_of_copy', 0):.1%}",
                     _num(r.get("decode_full_GBps"), 3), f"{r.get('decode_full_of_copy', 0):.1%}",
                     _num(r.get("decode_anchor_GBps"), 3)])
    return _table(["path", "tokens", "layers", "copy GB/s", "encode GB/s", "encode / copy", "decode GB/s",
                   "decode / copy", "anchor-only decode GB/s"], rows)


def transfer_table(data: Any) -> str:
    rows = []
    for r in _need(data, "rows"):
        if "ctx" not in r:
            continue
        rows.append([f"{r['link_gbps']:g}", str(r["ctx"]), f"{r['raw_s'] * 1e3:.1f}", f"{r['sched_e2e_s'] * 1e3:.1f}",
                     f"{r['overhead_e2e']:+.1%}", f"{r['raw_gbps']:.2f}", f"{r['backlog_anchor_vs_ideal']:.2f}x"])
    note = (f"residual chunks {data.get('residual_chunk_kib', '?')} KiB, window {data.get('residual_window', '?')}; "
            f"link: {data.get('emulation', 'not recorded')}\n\n")
    return note + _table(["link Gb/s", "ctx", "raw ms", "sched e2e ms", "overhead", "raw Gb/s achieved",
                          "anchor behind backlog vs ideal"], rows)


TTKT_KS = (1, 8, 32, 64)


def ttkt_table(data: Any) -> str:
    if isinstance(data, dict) and "grids" in data:  # the sweep: one run per (context, ratio) (ttkt_sweeps.py)
        return "\n\n".join(f"{grid['label'][:1].upper()}{grid['label'][1:]} (`{grid['source']}`). "
                             + ttkt_table(grid["data"]) for grid in data["grids"])
    table = _need(data, "table")
    if table and "ratio" in table[0]:  # bench_ttkt.py with --ratios (one deployment per mode, every ratio)
        from benchmark.serving.ttkt_report import describe_run, floors_from, table_lines

        return describe_run(data) + "\n\n" + "\n".join(table_lines(table, floors_from(data)))
    rows = []
    for e in _need(data, "table"):
        rows.append([str(e["mode"]), str(e["context"]), str(e["n"]), str(e.get("errors", 0)),
                     f"{e.get('found', 0)}/{e['n']}", *(_num(e.get(f"tt{k}t")) for k in TTKT_KS)])
    link = (data.get("meta") or {}).get("link", "")
    head = f"link: {link}; medians over requests\n\n" if link else ""
    return head + _table(["mode", "context", "n", "errors", "needle found", *(f"TT{k}T (s)" for k in TTKT_KS)], rows)


def serving_table(data: Any) -> str:
    table = sweep_table(_need(data, "rows"))
    skipped = data.get("skipped_modes") or {}
    lines = [f"- {mode} skipped: {why[:200]}" for mode, why in skipped.items()]
    settings = data.get("settings") or {}
    head = (f"{settings.get('num_prompts', '?')} prompts per run, random inputs of "
            f"{settings.get('input_len', '?')} tokens (range ratio {settings.get('range_ratio', '?')}), "
            f"{settings.get('output_len', '?')} output tokens; times in ms\n\n")
    lines += [f"- rows from an earlier run ({p.get('time_utc', '?')}): {stamp(p)}"
              for p in data.get("earlier_provenance") or []]
    return head + table + ("\n" + "\n".join(lines) + "\n" if lines else "")


def accuracy_rows_of(data: Any) -> list[AccuracyRow]:
    return [AccuracyRow(**row) for row in _need(data, "rows")]


def accuracy_section_table(data: Any) -> str:
    if isinstance(data, dict) and "grids" in data:  # every grid, combined (reporting/accuracy_grids.py)
        return accuracy_grids_table(data)
    text = accuracy_table(accuracy_rows_of(data))
    agreement = [AgreementRow(**row) for row in data.get("agreement") or []]
    if agreement:
        text += "\nOutput-token agreement with bf16 (same prompts):\n\n" + agreement_table(agreement, "bf16")
    skipped = data.get("skipped_modes") or {}
    text += "".join(f"\n- {mode} skipped: {why[:200]}" for mode, why in skipped.items())
    runs = data.get("mode_run_utc") or {}
    if data.get("earlier_provenance"):
        text += "\n- run of each mode (UTC): " + ", ".join(f"{m} {t}" for m, t in runs.items())
        text += "".join(f"\n- modes from an earlier run: {stamp(p)}" for p in data["earlier_provenance"])
    return text


REFERENCE_MODE, LOSSLESS_PAIR = "bf16", ("lynx-int8", "lynx")


def grid_records_of(data: Any) -> list[Record]:
    return [record for grid in _need(data, "grids") for record in _need(grid, "records")]


def accuracy_summaries(data: Any) -> list[ModeSummary]:
    """Per (mode, context) over the tasks every cell of every grid has (benchmark/accuracy/summary.py)."""
    return mode_summaries(grid_records_of(data), reference_mode=REFERENCE_MODE)


def _mode_order(modes: set[str]) -> list[str]:
    return [m for m in ALL_MODES if m in modes] + sorted(modes - set(ALL_MODES))


def _summary_cells(row: ModeSummary | None) -> list[str]:
    if row is None:
        return ["-", "-", "-"]
    score = f"{100 * row.mean:.1f} +- {100 * row.std:.1f} ({100 * row.minimum:.0f}-{100 * row.maximum:.0f})"
    if row.errors:
        score += f", {row.errors} err"
    delta = "-" if row.delta_points is None else f"{row.delta_points:+.1f}"
    same = "-" if row.matched is None else f"{row.identical}/{row.matched}"
    return [score, delta, same]


def accuracy_grids_table(data: Any) -> str:
    """One row per mode, three columns per context length: the score over the common tasks (mean
    over seeds +- population std across seeds, min-max of the seed scores, in %), its difference
    from bf16 in points, and the outputs token-identical to bf16; then the lossless check (lynx
    against lynx-int8) and one line per grid: which context lengths it supplies, its seeds and
    instances, and where its per-task rows are."""
    grids = _need(data, "grids")
    records = grid_records_of(data)
    summaries = accuracy_summaries(data)
    cells = {(s.mode, s.context_tokens): s for s in summaries}
    contexts = sorted({s.context_tokens for s in summaries})
    tasks = summaries[0].tasks
    header = ["mode"] + [f"{_context_label(c)} {label}" for c in contexts
                         for label in ("score %", f"vs {REFERENCE_MODE} (points)", f"= {REFERENCE_MODE}")]
    rows = [[mode, *(cell for c in contexts for cell in _summary_cells(cells.get((mode, c))))]
            for mode in _mode_order({s.mode for s in summaries})]
    left_out = sorted({str(r["task"]) for r in records} - set(tasks))
    head = (f"Mean score over the tasks measured at every context length ({', '.join(tasks)}; each task "
            "weighs the same), in %: mean over seeds +- std across seeds (min-max of the seed scores). "
            f"`vs {REFERENCE_MODE}`: difference of the means in points; `= {REFERENCE_MODE}`: outputs "
            f"token-identical to {REFERENCE_MODE} on the same prompt (of the pairs where both requests "
            "succeeded). Greedy decoding.")
    if left_out:
        head += f" Left out of the means (not measured at every context length): {', '.join(left_out)}."
    lines = [head, "", _table(header, rows).rstrip("\n")]
    base, spec = LOSSLESS_PAIR
    counts = identical_counts([r for r in records if r["mode"] == base], [r for r in records if r["mode"] == spec])
    if counts:
        checks = ", ".join(f"{_context_label(c)} {counts[(spec, c)][0]}/{counts[(spec, c)][1]}"
                           for c in contexts if (spec, c) in counts)
        lines += ["", f"Lossless check, {spec} against {base} (the KV it verifies on), output tokens identical "
                      f"instance by instance (all tasks of each grid): {checks}."]
    lines.append("")
    for grid in grids:
        per_mode = {s.mode: s for s in summaries if s.context_tokens in grid["contexts"]}
        instances = sorted({sum(1 for r in grid["records"] if r["mode"] == m) for m in per_mode})
        seeds = sorted({s.seeds for s in per_mode.values()})
        lines.append(f"- {', '.join(_context_label(c) for c in grid['contexts'])} from `{grid['source']}`: "
                     f"{'/'.join(str(n) for n in seeds)} seeds, {'/'.join(str(n) for n in instances)} instances "
                     f"per mode (all its tasks); per-task rows with the seed spread and token agreement: "
                     f"`{grid['details']}`")
        lines += [f"- {mode} skipped in that grid: {why[:200]}" for mode, why in grid["skipped_modes"].items()]
        lines += _kept_from_earlier_runs(grid, set(per_mode))
    return "\n".join(lines) + "\n"


def _kept_from_earlier_runs(grid: dict[str, Any], modes: set[str]) -> list[str]:
    """Lines naming the modes a --merge run kept from an earlier run of the grid, with that run's stamp."""
    now = grid["provenance"].get("time_utc")
    older = {m: t for m, t in grid.get("mode_run_utc", {}).items() if m in modes and t != now}
    if not older:
        return []
    kept = ", ".join(f"{m} (run {t})" for m, t in older.items())
    lines = [f"  - modes kept from an earlier run of that grid: {kept}"]
    lines += [f"  - earlier run: {stamp(p)}" for p in grid.get("earlier_provenance", [])
              if p.get("time_utc") in older.values()]
    return lines


def _context_label(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def decode_table(data: Any) -> str:
    rows = [[str(data.get("dtype", "?")), str(_need(data, "prompts")),
             f"{data['extend_vs_decode_argmax_equal']}/{data['extend_vs_decode_positions']}",
             f"{data.get('max_abs_logit_diff', float('nan')):.2e}",
             f"{data.get('fully_accepted', '?')}/{data['prompts']}",
             f"{data.get('released_equal_full_kv_greedy', '?')}/{data['prompts']}"]]
    return _table(["dtype", "prompts", "argmax equal (verify vs decode)", "max abs logit diff",
                   f"all {data.get('drafts_per_prompt', '?')} drafts accepted", "released = full-KV greedy"], rows)


def transfer_modes_table(data: Any) -> str:
    from benchmark.transfer.bench_modes import markdown

    return f"link emulation: {data.get('emulation', '?')}; medians over repeats\n\n" + "\n".join(
        markdown(_need(data, "rows")))


TABLES: dict[str, Callable[[Any], str]] = {
    "codec_drafts": codec_drafts_table,
    "codec_throughput": codec_throughput_table,
    "kernels": kernels_table,
    "page_reuse": page_reuse_table,
    "transfer": transfer_table,
    "transfer_modes": transfer_modes_table,
    "ttkt": ttkt_table,
    "serving": serving_table,
    "accuracy": accuracy_section_table,
    "decode": decode_table,
}
