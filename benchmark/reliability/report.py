"""The soak's markdown report (``soak.md``) from its results dict (``soak.json``): pure."""

from __future__ import annotations

from typing import Any

from benchmark.provenance import stamp
from benchmark.reliability.outcomes import OUTCOMES

_UNITS = {"rss_mib": "RSS MiB", "sockets": "sockets", "threads": "threads"}


def _outcome_cells(row: dict[str, Any]) -> str:
    return " | ".join(str(row.get(o, 0)) for o in OUTCOMES)


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    head = "| correct | clear error | aborted | no space | wrong | lost |"
    lines = [f"| class | requests {head} p50 s | p95 s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, row in s["by_kind"].items():
        lines.append(f"| {kind} | {row['requests']} | {_outcome_cells(row)} | {row['p50_s']} | {row['p95_s']} |")
    lines.append(f"| **all** | {s['requests']} | | | | **{s.get('no_space', 0)}** | **{s['wrong']}** | "
                 f"**{s['lost']}** | {s['p50_s']} | {s['p95_s']} |")
    restart = report.get("restart")
    if s.get("by_phase") and restart:
        lines += ["", f"Prefill restart: killed at {restart.get('kill_s')} s with {restart.get('in_flight_at_kill')} "
                  f"requests in flight; healthy again {restart.get('prefill_healthy_after_s')} s after the kill "
                  f"started its restart, routing again {restart.get('routable_after_kill_s')} s after the kill"
                  + (f"; **{restart['error']}**" if restart.get("error") else "") + ".", "",
                  f"| phase | requests {head}", "|---|---|---|---|---|---|---|---|"]
        for phase, row in s["by_phase"].items():
            lines.append(f"| {phase} | {row['requests']} | {_outcome_cells(row)} |")
    resources = report.get("resources") or {}
    servers = [k for k in resources if k != "all_flat"]
    if servers:
        lines += ["", "| server | quantity | start | warm-up | end | max | limit | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in servers:
            res = resources[name]
            label = name if res.get("segments", 1) <= 1 else f"{name} (after restart)"
            for q, unit in _UNITS.items():
                r = res.get(q) or {}
                lines.append(f"| {label} | {unit} | {r.get('start')} | {r.get('warmup')} | {r.get('end')} | "
                             f"{r.get('max')} | {r.get('limit')} ({r.get('tolerance')}) | {r.get('verdict')} |")
    mem = report.get("memory", {})
    if mem:
        lines += ["", "| server | idle at end | /health_generate |", "|---|---|---|"]
        for name, m in mem.items():
            idle = "yes" if not m.get("idle_problems") else m["idle_problems"]
            lines.append(f"| {name} | {idle} | {m.get('health_generate')} |")
    if report.get("config_dropped"):
        lines += ["", f"Config keys the installed LynxConfig does not know (not sent): {report['config_dropped']}."]
    lines += ["", f"Elapsed {report.get('soak_s')} s of soak; verdict: **{report.get('verdict')}**.", "",
              stamp(report.get("provenance"))]
    return "\n".join(lines) + "\n"
