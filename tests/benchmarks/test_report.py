"""The report command's pure parts: marker splicing, latest-file choice, provenance, section rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark.report import END, START, build_section, render_report, render_section, splice
from benchmark.reporting.sources import AREAS, Area, latest, provenance_of
from report_fixtures import SERVING_RESULT

AREA = {a.key: a for a in AREAS}


def test_splice_replaces_only_the_marked_block() -> None:
    text = f"# Title\n\nhand-written\n\n{START}\nold generated\n{END}\n\n## Later hand-written\n"
    out = splice(text, f"{START}\nnew\n{END}")
    assert out == f"# Title\n\nhand-written\n\n{START}\nnew\n{END}\n\n## Later hand-written\n"
    assert splice(out, f"{START}\nnew\n{END}") == out  # idempotent


def test_splice_appends_when_no_markers_and_refuses_broken_ones() -> None:
    assert splice("# T\nbody\n", f"{START}\nx\n{END}") == f"# T\nbody\n\n{START}\nx\n{END}\n"
    with pytest.raises(ValueError, match="only one"):
        splice(f"# T\n{START}\n", "x")
    with pytest.raises(ValueError, match="more than one"):
        splice(f"{START}{END}{START}{END}", "x")


def test_latest_prefers_the_newest_recorded_run(tmp_path: Path) -> None:
    area = Area("serving", "t", ("r/*/serving.json",))
    for name, when in (("a", "2026-11-30T10:00:00Z"), ("b", "2026-12-01T07:00:00Z"), ("c", "2026-11-29T09:00:00Z")):
        (tmp_path / "r" / name).mkdir(parents=True)
        (tmp_path / "r" / name / "serving.json").write_text(json.dumps({"provenance": {"time_utc": when}}))
    found = latest(area, tmp_path)
    assert found is not None and found[0].parent.name == "b"
    assert latest(Area("x", "t", ("nothing/*.json",)), tmp_path) is None


def test_legacy_provenance_is_filled_from_what_the_file_recorded(tmp_path: Path) -> None:
    legacy = {"command": "bench_streams.py --link-gbps 1", "machine": "vm x86_64 2 cores", "rows": []}
    prov = provenance_of(legacy, tmp_path / "results.json", tmp_path)
    assert prov["command"] == "bench_streams.py --link-gbps 1" and prov["machine"] == "vm x86_64 2 cores"
    assert prov["commit"].startswith("not recorded")
    meta = {"meta": {"command": "python x.py", "machine": "m", "commit": "abc1234", "time": "2026-11-29 10:56:07"}}
    assert provenance_of(meta, tmp_path / "t.json", tmp_path)["commit"] == "abc1234"


def test_serving_section_is_stamped_and_tabulated(tmp_path: Path) -> None:
    path = tmp_path / "benchmark" / "serving" / "results" / "serving.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(SERVING_RESULT))
    section = build_section(AREA["serving"], path, SERVING_RESULT, tmp_path, figures_dir=None)
    text = render_section(section)
    assert "- Source: `benchmark/serving/results/serving.json`" in text
    assert "2 CPUs (AMD EPYC), 23.5 GiB, GPU none, load avg 4.2 (load avg at the end 6.5)" in text
    assert "- Commit: 1234abc; run 2026-12-01T07:20:00Z" in text
    assert "- Command: `OMP_NUM_THREADS=1 python benchmark/serving/bench_serving_sweep.py --modes int8`" in text
    assert "| int8 | 0.100 | 2/2 |" in text and "- lynx skipped: deployment failed to start" in text


def test_figure_is_written_and_linked(tmp_path: Path) -> None:
    section = build_section(AREA["serving"], tmp_path / "serving.json", SERVING_RESULT, tmp_path, tmp_path / "fig")
    assert section.problem == "" and section.figure == "fig/serving.png"
    assert (tmp_path / "fig" / "serving.png").stat().st_size > 1000
    assert "![Serving: bench_serving request-rate sweep per mode](fig/serving.png)" in render_section(section)


def test_malformed_file_says_so_instead_of_a_half_table(tmp_path: Path) -> None:
    section = build_section(AREA["serving"], tmp_path / "serving.json", {"provenance": {}}, tmp_path, None)
    assert "could not be rendered" in section.problem and section.table == ""
    assert "could not be rendered" in render_section(section)


def test_report_lists_missing_areas_between_markers() -> None:
    from benchmark.report import Section

    text = render_report([Section(AREA["decode"], "", {}, "", "")], {"commit": "c0ffee0", "time_utc": "now"})
    assert text.startswith(START) and text.endswith(END)
    looked_for = ", ".join(f"`{pattern}`" for pattern in AREA["decode"].patterns)
    assert f"No machine-readable results yet (looked for: {looked_for})" in text


def test_uncommitted_changes_are_named_in_the_stamp(tmp_path: Path) -> None:
    data = {**SERVING_RESULT, "provenance": {**SERVING_RESULT["provenance"],
                                             "dirty_files": ["python/a.py", "python/b.py"]}}
    text = render_section(build_section(AREA["serving"], tmp_path / "s.json", data, tmp_path, None))
    assert "- Commit: 1234abc; run 2026-12-01T07:20:00Z (+dirty: 2 tracked files" in text
    assert "`python/a.py`, `python/b.py`" in text


def test_page_reuse_section_is_tabulated(tmp_path: Path) -> None:
    data = {"provenance": {}, "mode": "lynx", "rows": [
        {"tokens": 4096, "shared_tokens": 2048, "pages_reused": 8, "cold_s": 0.126, "reuse_s": 0.093,
         "speedup": 1.355}]}
    section = build_section(AREA["page_reuse"], tmp_path / "page_reuse.json", data, tmp_path, figures_dir=None)
    assert section.problem == ""
    assert "| 4096 | 2048 | 8 | 0.126 | 0.093 | 1.35x |" in section.table
    broken = build_section(AREA["page_reuse"], tmp_path / "page_reuse.json", {"rows": [{"tokens": 1}]}, tmp_path, None)
    assert "could not be rendered" in broken.problem


def test_codec_throughput_shows_the_exact_runs_and_no_lone_copy_row() -> None:
    from benchmark.reporting.tables import codec_throughput_table

    m = {"threads": [1, 2], "loadavg_1min": [0.4, 0.5], "memcpy_mb_s": 10000.0, "memcpy_mb_s_2t": 11000.0}
    for t, enc, dec in (("", 600.0, 700.0), ("_2t", 900.0, 1100.0), ("_2t_layers", 1000.0, 1300.0)):
        copy = m["memcpy_mb_s" if not t else "memcpy_mb_s_2t"]
        m.update({f"encode_mb_s{t}": enc, f"decode_mb_s{t}": dec, f"encode_share_of_memcpy{t}": enc / copy,
                  f"decode_share_of_memcpy{t}": dec / copy})
    data = {"rows": [{"codec": "memory copy", "kind": "-", "encode_gbs": 38.0, "decode_gbs": 38.0}],
            "exact": {"lengths": {"1024": m}}}
    text = codec_throughput_table(data)
    assert "not timed in this run" in text and "| memory copy |" not in text
    assert "| 1024 | 1 | 0.600 | 6.00% | 0.700 | 7.00% |" in text
    assert "| 1024 | 2, layers at once | 1.000 | 9.09% | 1.300 | 11.82% |" in text
    data["rows"].append({"codec": "int8", "kind": "k", "encode_gbs": 0.4, "decode_gbs": 2.2})
    assert "| int8 | k | 0.400 | 2.200 |" in codec_throughput_table(data)
