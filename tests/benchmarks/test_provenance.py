"""Provenance helper: memory from meminfo, command line, one-line stamps."""

from __future__ import annotations

from pathlib import Path

from benchmark.provenance import command_line, is_output_file, machine, machine_summary, mem_total_gib, stamp


def test_mem_total_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:        12056144 kB\n")
    assert mem_total_gib(meminfo) == 23.5
    assert mem_total_gib(tmp_path / "absent") is None


def test_machine_records_cores_memory_and_load() -> None:
    mach = machine()
    assert isinstance(mach["nproc"], int) and mach["nproc"] >= 1 and len(mach["loadavg"]) == 3


def test_command_line_records_env_and_relative_script(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = str(Path(__file__).resolve().parents[2] / "benchmark" / "serving" / "bench_serving_sweep.py")
    assert command_line([script, "--modes", "int8 x"]) == (
        "OMP_NUM_THREADS=1 python benchmark/serving/bench_serving_sweep.py --modes 'int8 x'")
    assert command_line(["ignored", "--a"], module="benchmark.report").endswith("python -m benchmark.report --a")


def test_stamps() -> None:
    mach = {"arch": "x86_64", "nproc": 2, "cpu": "AMD EPYC", "mem_gib": 23.5, "gpu": "none", "loadavg": [3.0, 2, 1]}
    assert machine_summary(mach) == "x86_64, 2 CPUs (AMD EPYC), 23.5 GiB, GPU none, load avg 3.0"
    assert machine_summary("vm x86_64 2 cores") == "vm x86_64 2 cores"
    assert stamp({"machine": mach, "commit": "abc", "command": "python x.py"}) == (
        "machine: x86_64, 2 CPUs (AMD EPYC), 23.5 GiB, GPU none, load avg 3.0; commit abc; command: python x.py")
    assert stamp(None) == "provenance not recorded"


def test_results_and_docs_are_not_counted_as_uncommitted_code() -> None:
    assert is_output_file("benchmark/accuracy/results/modes/bf16.jsonl") and is_output_file("README.md")
    assert not is_output_file("python/sglang_lynx/integration/transport/kv_manager.py")
