"""Tables and plots of the time-to-k-th-token benchmark (``bench_ttkt.py``): pure functions of its rows.

- :func:`summarize`: one entry per (mode, context, ratio): medians of TT1T/TT8T/TT32T/TT64T and of
  the Lynx fields (drafts, accepted, verify time, anchor/residual landed), counts of errors.
- :func:`headline`: per (context, ratio) issue 14's target ratios: TT1T(int8) / TT1T(lynx) (>= 1.43 at 1.4K
  tokens and ratio 64), TT1T(raw) / TT1T(lynx) (>= 2.0 there; raw: the earlier stock configuration that
  ran), TT32T(int8) / TT32T(lynx) (>= 1.2 there), whether TTkT(lynx) <= TTkT(int8) for every k (every
  cell at ratio >= 16), and TT1T(lynx) / TT1T(int4)
  (the first token as early as int4's).
- :func:`late_pace`: a request's decode pace once its drafts are behind it (median gap between tokens
  33-64, None where its verify released token 33 or later, i.e. >= 31 drafts): whether a drafted request
  decodes slower after its verify than one that never drafted.
- :func:`hidden_lines`: per mode and cell, how much of the transfer its first token waits for was hidden
  behind the prefill (streaming per chunk or per layer group), from the TT1T floor the run measured.
- :func:`plot_bars` (TTkT per mode, one panel per ratio) and :func:`plot_timeline` (tokens released
  against time per mode, one request, like the paper's Figure 1).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmark.model_shape import KVShape
from benchmark.provenance import stamp, stamp_figure

KS = (1, 8, 32, 64)
LYNX_FIELDS = ("lynx_drafts", "lynx_accepted", "lynx_bonus", "lynx_verify_s", "lynx_upgrade_s", "lynx_anchor_landed_s",
               "lynx_residual_landed_s", "lynx_full_ready_s", "lynx_exact_ahead", "lynx_fallback")
_NUMERIC = LYNX_FIELDS[:-1]


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = list(dict.fromkeys((r["mode"], r["context"], r["ratio"]) for r in rows))
    table = []
    for mode, ctx, ratio in keys:
        sel = [r for r in rows if (r["mode"], r["context"], r["ratio"]) == (mode, ctx, ratio)]
        ok = [r for r in sel if not r.get("error")]
        entry: dict[str, Any] = {"mode": mode, "context": ctx, "ratio": ratio, "link_gbps": sel[0]["link_gbps"],
                                 "n": len(sel), "errors": len(sel) - len(ok), "found": sum(r["found"] for r in sel)}
        for k in KS:
            entry[f"tt{k}t"] = _median([r[f"tt{k}t"] for r in ok])
        for f in _NUMERIC:
            entry[f] = _median([r.get(f) for r in ok])
        entry["pace_late_s"] = _median([late_pace(r) for r in ok])
        entry["fallbacks"] = sum(1 for r in ok if r.get("lynx_fallback"))
        entry["same_as_raw"] = _same_as_raw(rows, ok)
        table.append(entry)
    return table


LATE_FROM = 33  # the first token (1-based) of the late window: past any draft window of <= 30 drafts


def late_pace(row: dict[str, Any]) -> float | None:
    """Median seconds between consecutive tokens ``LATE_FROM``..64 of one request, when every one of them
    came from a plain decode step: the tokens its verify released (tokens 2 to ``drafts`` + 2 at most, a
    bonus included; token 1 comes from the admission's prefill step) all lie before ``LATE_FROM``. None
    otherwise, or with fewer than 64 token times."""
    times = row.get("token_times") or []
    drafts = row.get("lynx_drafts") or 0
    if len(times) < 64 or drafts + 2 >= LATE_FROM:
        return None
    late = times[LATE_FROM - 1:64]
    return statistics.median(b - a for a, b in zip(late[:-1], late[1:], strict=True))


def _same_as_raw(rows: list[dict[str, Any]], sel: list[dict[str, Any]]) -> int | None:
    """How many of ``sel`` streamed the same text as ``raw`` for the same prompt (None: no raw row, or
    rows from before the text was recorded)."""
    raw = {(r["context"], r["ratio"], r["seed"]): r.get("text")
           for r in rows if r["mode"] == "raw" and not r.get("error")}
    pairs = [(r.get("text"), raw.get((r["context"], r["ratio"], r["seed"]))) for r in sel]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in pairs) if pairs else None


def _get(table: list[dict[str, Any]], mode: str, ctx: int, ratio: float, key: str) -> float | None:
    hit = next((e for e in table if (e["mode"], e["context"], e["ratio"]) == (mode, ctx, ratio)), None)
    return None if hit is None else hit.get(key)


def floors_from(meta: dict[str, Any]) -> dict[int, float]:
    """Per context, the TT1T floor the calibration measured (``bench_ttkt.calibrate``: the first token
    on an unthrottled link, i.e. the prefill, a negligible transfer and one decode step); {} for runs
    from before it was recorded."""
    calib = meta.get("calibration") or {}
    return {int(k): float(v["tt1t_floor_s"]) for k, v in calib.items() if v.get("tt1t_floor_s")}


def _best_raw(table: list[dict[str, Any]], ctx: int, ratio: float, key: str) -> float | None:
    """The earlier of stock SGLang PD's configurations in the cell (``raw`` and its server variants, e.g.
    ``raw~no-overlap``: on a CPU host the overlap scheduler sends a chunk's KV only after the next chunk's
    forward, so the non-overlap one hides more of a chunked prefill's transfer)."""
    vals = [e[key] for e in table if e["mode"].partition("~")[0] == "raw"
            and (e["context"], e["ratio"]) == (ctx, ratio) and e[key] is not None]  # fmt: skip
    return min(vals) if vals else None


def headline(table: list[dict[str, Any]], floors: dict[int, float] | None = None) -> list[dict[str, Any]]:
    """Per (context, ratio): issue 14's target ratios (module docstring); None where a mode is missing;
    ``raw``: the earlier of the stock configurations that ran (:func:`_best_raw`).
    With ``floors`` (:func:`floors_from`), also the bound the prefill puts on the TT1T ratios: no mode's
    first token comes before the floor, so TT1T(int8) / floor is the most TT1T(int8) / TT1T(lynx) can be."""

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num and den else None

    out = []
    for ctx, r in dict.fromkeys((e["context"], e["ratio"]) for e in table):
        t = {(m, k): _get(table, m, ctx, r, f"tt{k}t") for m in ("lynx", "int8", "int4") for k in KS}
        t.update({("raw", k): _best_raw(table, ctx, r, f"tt{k}t") for k in KS})
        pairs = [(t[("lynx", k)], t[("int8", k)]) for k in KS]
        floor = (floors or {}).get(int(ctx))
        out.append({"context": ctx, "ratio": r, "tt1t_floor_s": floor,
                    "tt1t_int8_over_floor": ratio(t[("int8", 1)], floor),
                    "tt1t_raw_over_floor": ratio(t[("raw", 1)], floor),
                    "tt1t_int8_over_lynx": ratio(t[("int8", 1)], t[("lynx", 1)]),
                    "tt1t_raw_over_lynx": ratio(t[("raw", 1)], t[("lynx", 1)]),
                    "tt32t_int8_over_lynx": ratio(t[("int8", 32)], t[("lynx", 32)]),
                    "lynx_never_later_than_int8": (None if any(a is None or b is None for a, b in pairs)
                                                   else all(a <= b for a, b in pairs)),
                    "tt1t_lynx_over_int4": ratio(t[("lynx", 1)], t[("int4", 1)])})
    return out


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table_lines(table: list[dict[str, Any]], floors: dict[int, float] | None = None) -> list[str]:
    """The per-(mode, context, ratio) table and the headline ratios (with the prefill's bound where the
    run measured ``floors``), as markdown lines."""
    lines = ["| mode | context | ratio | link Gb/s | n | err | TT1T (s) | TT8T (s) | TT32T (s) | TT64T (s) | "
             "drafts | accepted | bonus | verify (s) | upgrade (s) | anchor landed (s) | residual landed (s) | "
             "fallbacks | text = raw |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        tts = " | ".join(_fmt(e[f"tt{k}t"]) for k in KS)
        lines.append(f"| {e['mode']} | {e['context']} | {e['ratio']:g} | {e['link_gbps']:.3f} | {e['n']} | "
                     f"{e['errors']} | {tts} | {_fmt(e['lynx_drafts'], '.0f')} | {_fmt(e['lynx_accepted'], '.0f')} | "
                     f"{_fmt(e.get('lynx_bonus'), '.0f')} | {_fmt(e['lynx_verify_s'], '.3f')} | "
                     f"{_fmt(e.get('lynx_upgrade_s'), '.3f')} | "
                     f"{_fmt(e['lynx_anchor_landed_s'])} | "
                     f"{_fmt(e['lynx_residual_landed_s'])} | {e['fallbacks']} | "
                     f"{'-' if e.get('same_as_raw') is None else e['same_as_raw']} |")
    bound = " TT1T floor (s) | bound: TT1T(int8) / floor | bound: TT1T(raw) / floor |" if floors else ""
    lines += ["", "| context | ratio | TT1T(int8) / TT1T(lynx) (>= 1.43) | TT1T(raw) / TT1T(lynx) (>= 2.0) | "
                  "TT32T(int8) / TT32T(lynx) (>= 1.2) | TTkT(lynx) <= TTkT(int8), every k | TT1T(lynx) / TT1T(int4) |"
                  + bound,
              "|---|---|---|---|---|---|---|" + ("---|---|---|" if floors else "")]
    for h in headline(table, floors):
        never = h["lynx_never_later_than_int8"]
        cells = (f" {_fmt(h['tt1t_floor_s'])} | {_fmt(h['tt1t_int8_over_floor'])} | {_fmt(h['tt1t_raw_over_floor'])} |"
                 if floors else "")
        lines.append(f"| {h['context']} | {h['ratio']:g} | {_fmt(h['tt1t_int8_over_lynx'])} | "
                     f"{_fmt(h['tt1t_raw_over_lynx'])} | {_fmt(h['tt32t_int8_over_lynx'])} | "
                     f"{'-' if never is None else ('yes' if never else 'no')} | {_fmt(h['tt1t_lynx_over_int4'])} |"
                     + cells)
    return lines


def first_token_bytes(mode: str, tokens: int, shape: KVShape) -> int:
    """Bytes a mode moves before its decode can start: ``raw`` (stock SGLang PD) the BF16 KV, a progressive Lynx
    mode (``lynx``, ``lynx-exact``) its anchor stream, any other mode all it sends (``lynx-int8``: anchor and
    residual; a mode of one stream: that stream); a ``MODE~VARIANT`` as its configuration says."""
    if mode.partition("~")[0] == "raw":
        return tokens * shape.bytes_per_token
    from benchmark.pd_modes import lynx_config

    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.codec.request import request_stream_bytes
    from sglang_lynx.codec.wire_residual import residual_wire_bytes
    from sglang_lynx.config import LynxConfig

    config = LynxConfig(**lynx_config(mode))
    codec = get_codec(config.codec_name, **config.codec_params())
    dims = (shape.layers, tokens, shape.kv_heads, shape.head_dim)
    anchor = request_stream_bytes(codec, *dims)[0]
    return int(anchor if config.progressive else anchor + residual_wire_bytes(codec, *dims))


def hidden_lines(table: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Per mode and cell: the first token's transfer alone on the link (its bytes at the cell's rate), the
    time TT1T came after the floor (the prefill and one decode step: what the transfer and the encode
    added), and the share of that transfer hidden behind the prefill, 1 - (TT1T - floor) / transfer. []
    without floors or the KV shape (runs from before either was recorded)."""
    floors, shape = floors_from(meta), meta.get("kv_shape")
    if not floors or not shape:
        return []
    lines = ["| mode | context | ratio | first-token bytes (MB) | their transfer alone (s) | TT1T - floor (s) | "
             "hidden |", "|---|---|---|---|---|---|---|"]
    for e in table:
        floor, calib = floors.get(int(e["context"])), meta["calibration"].get(str(e["context"]), {})
        if floor is None or e["tt1t"] is None or not calib.get("prompt_tokens"):
            continue
        nbytes = first_token_bytes(e["mode"], int(calib["prompt_tokens"]), KVShape(**shape))
        transfer = nbytes * 8 / (e["link_gbps"] * 1e9)
        exposed = e["tt1t"] - floor
        lines.append(f"| {e['mode']} | {e['context']} | {e['ratio']:g} | {nbytes / 1e6:.2f} | {transfer:.2f} | "
                     f"{exposed:.2f} | {1 - exposed / transfer:.0%} |")
    return lines


def describe_run(meta: dict[str, Any]) -> str:
    calib = ", ".join(f"{k} tok: {v['prompt_tokens']} prompt tokens, step {v['step_s'] * 1e3:.1f} ms"
                      + (f", TT1T floor {v['tt1t_floor_s']:.2f} s" if v.get("tt1t_floor_s") else "")
                      for k, v in meta.get("calibration", {}).items())
    floor = (" The TT1T floor is the first token on the unthrottled link, on the first mode's deployment (the "
             "prefill, a negligible transfer and one decode step; the fastest of the calibration's requests): no "
             "mode can start earlier, so "
             "TT1T(X) / floor bounds TT1T(X) / TT1T(lynx).") if floors_from(meta) else ""
    return f"Link: {meta.get('link')}. Calibration (decode step per context): {calib}.{floor}"


def markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [stamp(meta.get("provenance")), "", describe_run(meta), "", *table_lines(table, floors_from(meta))]
    if hidden := hidden_lines(table, meta):
        lines += ["", "How much of the first token's transfer the prefill hid (transfer alone: the mode's anchor, "
                      "or all its KV for one-stream modes and raw, at the cell's link rate; the floor: prefill + one "
                      "decode step on the unthrottled link):", "", *hidden]
    return "\n".join(lines) + "\n"


def plot_bars(table: list[dict[str, Any]], path: Path, prov: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((e["context"], e["ratio"]) for e in table))
    modes = list(dict.fromkeys(e["mode"] for e in table))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4 * max(1, len(panels)), 4), squeeze=False)
    width = 0.8 / len(KS)
    for ax, (ctx, ratio) in zip(axes[0], panels, strict=False):
        for i, k in enumerate(KS):
            vals = [_get(table, m, ctx, ratio, f"tt{k}t") or 0.0 for m in modes]
            ax.bar([j + i * width for j in range(len(modes))], vals, width, label=f"TT{k}T")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes, rotation=45, ha="right")
        ax.set_title(f"{ctx} tokens, ratio {ratio:g}")
        ax.set_ylabel("seconds (median)")
    axes[0][0].legend()
    stamp_figure(fig, prov)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(rows: list[dict[str, Any]], path: Path, prov: dict[str, Any] | None = None) -> None:
    """Tokens released against time, per mode, for the first request at the highest ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({r["ratio"] for r in rows})
    if not ratios:
        return
    ratio, ctx = ratios[-1], min(r["context"] for r in rows)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        row = next((r for r in rows if (r["mode"], r["context"], r["ratio"]) == (mode, ctx, ratio)
                    and r["token_times"]), None)
        if row is None:
            continue
        times = row["token_times"]
        (line,) = ax.step(times, range(1, len(times) + 1), where="post", label=mode)
        if row.get("lynx_anchor_landed_s") is not None and row.get("lynx_residual_landed_s") is not None:
            ax.axvline(row["lynx_residual_landed_s"] + times[0] - (row.get("lynx_anchor_landed_s") or 0),
                       color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the request was sent")
    ax.set_ylabel("tokens released to the client")
    ax.set_title(f"Token arrival, {ctx} tokens, ratio {ratio:g}\n(dotted: residual landed, lynx modes; "
                 "aligned at token 1 = anchor landed)", fontsize=9)
    ax.legend()
    stamp_figure(fig, prov)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
