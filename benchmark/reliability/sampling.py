"""Resource sampling of server process groups, and the soak's flatness rule.

Every ``--sample-every-s`` the soak reads, for each server's process group (the server and every child
SGLang starts: scheduler, detokenizer), from ``/proc``: the resident memory (``VmRSS``, MiB), the open
sockets (fds whose link is ``socket:[...]``) and the threads (entries of ``/proc/<pid>/task``), summed
over the group. A sample names the group leader's pid, so a restarted server starts a new *segment*.

Flatness (:func:`flatness`), judged per server on its last segment (for a restarted prefill: the new
process, from its restart to the end): the *warm-up value* is the highest value seen in the first
``warmup_fraction`` (default 20 %) of the segment's time span (the high-water mark once caches, pools
and lazily started threads exist); the *end value* is the sample taken after the load has stopped and
the servers are idle. Flat: end <= warm-up * (1 + ``rss_rel_tol``) for RSS (2 %), end <= warm-up +
``count_tol`` for sockets and threads (default 2). A drop is not a failure (the end is read at idle,
the warm-up under load). The pure parts (:func:`segments`, :func:`flatness`, :func:`resource_summary`)
take sample rows and know nothing of ``/proc``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

QUANTITIES = ("rss_mib", "sockets", "threads")


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids of every process whose process group is ``pgid``."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _rss_kib(pid: int, proc: Path) -> int:
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _sockets(pid: int, proc: Path) -> int:
    n = 0
    for fd in (proc / str(pid) / "fd").iterdir():
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return n


def group_stats(pgid: int, proc: Path = Path("/proc")) -> dict[str, Any]:
    """RSS (MiB), open sockets and threads of process group ``pgid`` (a process that exits meanwhile is
    skipped); ``processes``: how many were read."""
    rss_kib = sockets = threads = processes = 0
    for pid in group_pids(pgid, proc):
        try:
            rss, sock, thr = _rss_kib(pid, proc), _sockets(pid, proc), len(os.listdir(proc / str(pid) / "task"))
        except (OSError, ValueError, IndexError):
            continue
        rss_kib, sockets, threads, processes = rss_kib + rss, sockets + sock, threads + thr, processes + 1
    return {"pgid": pgid, "processes": processes, "rss_mib": round(rss_kib / 1024, 1), "sockets": sockets,
            "threads": threads}


# ----------------------------------------------------------------------------------------- pure parts

def segments(samples: list[dict[str, Any]], server: str) -> list[list[dict[str, Any]]]:
    """``server``'s readings (``{"t", "label", "pgid", rss_mib, sockets, threads}``) split where its pgid
    changes (a restart), in time order. ``samples``: rows ``{"t", "label", server: reading or None}``."""
    out: list[list[dict[str, Any]]] = []
    for row in samples:
        reading = row.get(server)
        if not reading or not reading.get("processes"):
            continue
        point = {"t": row["t"], "label": row.get("label", ""), **reading}
        if out and out[-1][-1]["pgid"] == point["pgid"]:
            out[-1].append(point)
        else:
            out.append([point])
    return out


def flatness(points: list[dict[str, Any]], quantity: str, *, warmup_fraction: float = 0.2,
             rss_rel_tol: float = 0.02, count_tol: int = 2, end_label: str | None = "end") -> dict[str, Any]:
    """Start / warm-up / end / max of ``quantity`` over one segment and whether it stayed flat (see the
    module docstring). Fewer than 2 points, or no point after the warm-up: verdict ``"too short"``; a
    segment whose last point is not the ``end_label`` sample (the server died first): ``"no end sample"``."""
    if not points:
        return {"verdict": "no samples"}
    t0, t1 = points[0]["t"], points[-1]["t"]
    cut = t0 + warmup_fraction * (t1 - t0)
    warm = [p[quantity] for p in points if p["t"] <= cut]
    after = [p for p in points if p["t"] > cut]
    values = [p[quantity] for p in points]
    row: dict[str, Any] = {"start": values[0], "warmup": max(warm), "end": values[-1], "max": max(values),
                           "max_after_warmup": max((p[quantity] for p in after), default=None),
                           "warmup_until_s": round(cut - t0, 1), "span_s": round(t1 - t0, 1), "samples": len(points)}
    if len(points) < 2 or not after:
        row["verdict"] = "too short"
        return row
    if end_label is not None and points[-1].get("label") != end_label:
        row["verdict"] = "no end sample"  # the process was gone before the end: its last reading is no end
        return row
    if quantity == "rss_mib":
        limit = row["warmup"] * (1 + rss_rel_tol)
        row["tolerance"] = f"+{rss_rel_tol:.0%}"
    else:
        limit = row["warmup"] + count_tol
        row["tolerance"] = f"+{count_tol}"
    row["limit"] = round(limit, 1)
    row["verdict"] = "flat" if row["end"] <= limit else "GREW"
    return row


def resource_summary(samples: list[dict[str, Any]], servers: tuple[str, ...], **rule: Any) -> dict[str, Any]:
    """Per server: the flatness of each quantity on its last segment, the number of segments (restarts + 1)
    and ``flat`` (every quantity flat); ``all_flat`` over the servers."""
    out: dict[str, Any] = {}
    for server in servers:
        segs = segments(samples, server)
        last = segs[-1] if segs else []
        rows = {q: flatness(last, q, **rule) for q in QUANTITIES}
        out[server] = {"segments": len(segs), "judged_from_t": last[0]["t"] if last else None,
                       **rows, "flat": all(r["verdict"] == "flat" for r in rows.values())}
    out["all_flat"] = all(out[s]["flat"] for s in servers)
    return out
