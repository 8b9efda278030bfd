"""``python -m benchmark.report``: gather the latest results of every area into BENCHMARKS.md.

For each area (benchmark/reporting/sources.py: codec, kernels, transfer, serving TTKT, serving
sweep, accuracy, decode) the latest machine-readable results file is read, rendered as a table
(reporting/tables.py) and, where the area has one, a PNG figure (reporting/figures.py, written to
``benchmark/figures/``). Every table and figure is stamped with the machine, the commit and the
command recorded in its results file. The generated text replaces what lies between

    <!-- report:start -->  and  <!-- report:end -->

in BENCHMARKS.md (appended at the end when the markers are absent); the hand-written text outside
the markers is left exactly as it was. An area with no results, or a malformed file, gets a line
saying so instead of a table. The accuracy area combines its files (one grid of context lengths
each, reporting/accuracy_grids.py), as does the TTkT sweep (the newest run per (context, ratio)
cell, reporting/ttkt_sweeps.py); such a section is stamped with every file it shows.

    python -m benchmark.report                 # rewrite the generated section and the figures
    python -m benchmark.report --print         # print the section, write nothing
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmark.provenance import REPO_ROOT, load_at_end, machine_summary, provenance, stamp
from benchmark.reporting.accuracy_grids import combine_grids
from benchmark.reporting.figures import FIGURES
from benchmark.reporting.sources import AREAS, Area, all_results, latest, provenance_of, relative
from benchmark.reporting.tables import TABLES
from benchmark.reporting.ttkt_sweeps import combine_sweeps

START, END = "<!-- report:start -->", "<!-- report:end -->"


@dataclass
class Section:
    area: Area
    source: str  # results file, relative to the repository root ("" when none)
    prov: dict[str, Any]
    table: str
    figure: str  # PNG path relative to the repository root ("" when none)
    problem: str = ""
    # a combined area: one (source, provenance, what it supplies) per results file it shows
    grids: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)


def build_section(area: Area, path: Path, data: Any, root: Path, figures_dir: Path | None) -> Section:
    """Table (and figure, when ``figures_dir`` is given) for one area's results file."""
    prov = provenance_of(data, path, root)
    return _render_into(Section(area, relative(path, root), prov, "", ""), data, root, figures_dir, stamp(prov))


def _render_into(section: Section, data: Any, root: Path, figures_dir: Path | None, caption: str) -> Section:
    try:
        section.table = TABLES[section.area.key](data)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        section.problem = f"results file could not be rendered ({type(exc).__name__}: {exc})"
        return section
    draw = FIGURES.get(section.area.key)
    if draw is not None and figures_dir is not None:
        try:
            section.figure = relative(draw(data, figures_dir / f"{section.area.key}.png", caption), root)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            section.problem = f"figure not drawn ({type(exc).__name__}: {exc})"
    return section


#: how a combined area turns its results files into one ``{"grids": [...]}`` (each grid: source, provenance,
#: the context lengths it supplies)
COMBINERS: dict[str, Callable[[list[tuple[str, Path, Any]], Path], dict[str, Any]]] = {
    "accuracy": combine_grids, "ttkt": combine_sweeps}


def build_combined_section(area: Area, files: list[tuple[str, Path, Any]], root: Path,
                           figures_dir: Path | None) -> Section:
    """Table (and figure) for an area drawn from several results files (accuracy: one grid each; the TTkT
    sweep: one run per context length)."""
    section = Section(area, ", ".join(relative(path, root) for _, path, _ in files), {}, "", "")
    try:
        data = COMBINERS[area.key](files, root)
    except (KeyError, ValueError, TypeError, OSError) as exc:
        section.problem = f"results files could not be combined ({type(exc).__name__}: {exc})"
        return section
    section.grids = [(g["source"], g["provenance"],
                      g.get("label") or "context " + ", ".join(str(c) for c in g["contexts"])) for g in data["grids"]]
    section.source = ", ".join(source for source, _, _ in section.grids)
    section.prov = section.grids[-1][1]
    caption = "; ".join(f"{what}: {stamp(prov)}" for _, prov, what in section.grids)
    return _render_into(section, data, root, figures_dir, caption)


def _dirty_note(prov: dict[str, Any]) -> str:
    files = prov.get("dirty_files") or []
    if not files:
        return ""
    shown = ", ".join(f"`{f}`" for f in files[:4]) + (", ..." if len(files) > 4 else "")
    return f" (+dirty: {len(files)} tracked files had uncommitted changes when it ran: {shown})"


def render_section(section: Section) -> str:
    lines = [f"### {section.area.title}", ""]
    if not section.source:
        return "\n".join(lines + ["No machine-readable results yet (looked for: "
                                  + ", ".join(f"`{p}`" for p in section.area.patterns) + ").", ""])
    for source, prov, what in section.grids or [(section.source, section.prov, "")]:
        when = f"; run {prov['time_utc']}" if prov.get("time_utc") else ""
        indent = "  " if what else ""
        lines += [f"- {what.capitalize()}: `{source}`" if what else f"- Source: `{source}`",
                  f"{indent}- Machine: {machine_summary(prov.get('machine'))}{load_at_end(prov)}",
                  f"{indent}- Commit: {prov.get('commit', 'not recorded')}{when}{_dirty_note(prov)}",
                  f"{indent}- Command: `{prov.get('command', 'not recorded')}`"]
    lines.append("")
    if section.problem:
        lines += [f"**{section.problem}**", ""]
    if section.table:
        lines += [section.table.rstrip(), ""]
    if section.figure:
        lines += [f"![{section.area.title}]({section.figure})", ""]
    return "\n".join(lines)


def render_report(sections: list[Section], report_prov: dict[str, Any]) -> str:
    head = [START, "", "## Latest results per area (generated)", "",
            f"Generated by `python -m benchmark.report` on commit {report_prov.get('commit', '?')} at "
            f"{report_prov.get('time_utc', '?')} from each area's latest results file; do not edit between the "
            "report markers (rerun the command). Each table and figure carries the machine, commit and command "
            "its results file recorded; timings from a shared machine are noisy (the load average is in each "
            "stamp where it was recorded).", ""]
    return "\n".join(head + [render_section(s) for s in sections] + [END])


def splice(text: str, generated: str) -> str:
    """Replace the marked block of ``text`` with ``generated`` (which includes the markers)."""
    if text.count(START) > 1 or text.count(END) > 1:
        raise ValueError("BENCHMARKS.md has more than one report block")
    if START in text and END in text:
        before, rest = text.split(START, 1)
        if END not in rest:
            raise ValueError("report end marker comes before the start marker")
        after = rest.split(END, 1)[1]
        return before + generated + after
    if START in text or END in text:
        raise ValueError("BENCHMARKS.md has only one of the two report markers")
    return text.rstrip("\n") + "\n\n" + generated + "\n"


def collect(root: Path, figures_dir: Path | None) -> list[Section]:
    sections = []
    for area in AREAS:
        if area.combine:
            files = all_results(area, root)
            sections.append(build_combined_section(area, files, root, figures_dir) if files
                            else Section(area, "", {}, "", ""))
            continue
        found = latest(area, root)
        if found is None:
            sections.append(Section(area, "", {}, "", ""))
        else:
            sections.append(build_section(area, found[0], found[1], root, figures_dir))
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    parser.add_argument("--figures-dir", type=Path, default=REPO_ROOT / "benchmark" / "figures")
    parser.add_argument("--print", dest="print_only", action="store_true", help="print the section, write nothing")
    args = parser.parse_args(argv)
    report_prov = provenance(module="benchmark.report")
    sections = collect(REPO_ROOT, None if args.print_only else args.figures_dir)
    generated = render_report(sections, report_prov)
    if args.print_only:
        print(generated)
        return 0
    text = args.benchmarks.read_text() if args.benchmarks.exists() else "# sglang-lynx benchmarks\n"
    args.benchmarks.write_text(splice(text, generated))
    found = sum(bool(s.source) for s in sections)
    print(f"wrote {args.benchmarks} ({found}/{len(sections)} areas with results) and figures in {args.figures_dir}")
    for s in sections:
        print(f"  {s.area.key}: {s.source or 'no results'} {s.problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
