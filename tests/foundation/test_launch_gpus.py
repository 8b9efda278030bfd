"""One GPU (range) per server on a CUDA host: ``launch/gpus.py`` and the launcher's use of it (issue 17).

Unit tier only: no GPU was lent to this project's sessions, so the placement is checked on the
command lines the launcher builds (``SGLANG_LYNX_PLATFORM=cuda`` forces the CUDA branch here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_lynx.launch import __main__ as launch_main
from sglang_lynx.launch.deployment import PDDeployment, SingleServer
from sglang_lynx.launch.gpus import (
    GpuPlacementError,
    check_not_owned,
    flag_value,
    place_servers,
    tp_size_of,
    visible_gpus,
)


def _bases(placements: list) -> list[tuple[int, ...]]:
    return [tuple(p.gpus) for p in placements]


def test_each_server_gets_its_own_contiguous_tp_range() -> None:
    assert _bases(place_servers(["prefill", "decode"], 1, 2)) == [(0,), (1,)]
    two_p_one_d = place_servers(["prefill0", "prefill1", "decode"], 2, 8, base_gpu_id=2)
    assert _bases(two_p_one_d) == [(2, 3), (4, 5), (6, 7)]
    assert [p.argv() for p in two_p_one_d] == [["--base-gpu-id", "2"], ["--base-gpu-id", "4"], ["--base-gpu-id", "6"]]
    with_fraction = place_servers(["prefill", "decode0", "decode1"], 1, 4, mem_fraction=0.7)
    assert with_fraction[2].argv() == ["--base-gpu-id", "2", "--mem-fraction-static", "0.7"]


def test_servers_share_too_few_gpus_with_a_split_memory_fraction() -> None:
    one_gpu = place_servers(["prefill", "decode"], 1, 1)
    assert _bases(one_gpu) == [(0,), (0,)] and {p.mem_fraction for p in one_gpu} == {0.4}
    three_on_two = place_servers(["p0", "p1", "d"], 1, 2)
    assert _bases(three_on_two) == [(0,), (1,), (0,)] and {p.mem_fraction for p in three_on_two} == {0.4}
    assert {p.mem_fraction for p in place_servers(["p", "d"], 1, 1, mem_fraction=0.45)} == {0.45}
    with pytest.raises(GpuPlacementError, match="--mem-fraction 0.6: 2 servers share a GPU"):
        place_servers(["p", "d"], 1, 1, mem_fraction=0.6)


@pytest.mark.parametrize(("args", "message"), [
    ((["p", "d"], 2, 3, 0), "need 4 GPUs from GPU 0; the host shows 3"),
    ((["p", "d"], 1, 2, 2), "--base-gpu-id 2: the host shows 2 GPU"),
    ((["p", "d"], 1, 0, 0), "the host shows 0 GPU"),
    ((["p", "d"], 0, 2, 0), "--tp-size 0"),
])
def test_what_cannot_be_placed_is_refused_with_the_flag_named(args: tuple, message: str) -> None:
    with pytest.raises(GpuPlacementError, match=message):
        place_servers(*args)


def test_flags_and_gpu_count(tmp_path: Path) -> None:
    assert tp_size_of(["--lynx", "--tp-size", "2"]) == 2 and tp_size_of(["--tensor-parallel-size=4"]) == 4
    assert tp_size_of([]) == 1 and flag_value(["--x", "1", "--x=2"], ["--x"]) == "2"
    with pytest.raises(GpuPlacementError, match="--base-gpu-id after '--'"):
        check_not_owned(["--lynx", "--base-gpu-id", "3"])
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2 and visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev_dir=str(tmp_path)) == 2


def _gpu_flags(argv: list[str]) -> tuple[str | None, str | None]:
    return flag_value(argv, ["--base-gpu-id"]), flag_value(argv, ["--mem-fraction-static"])


def test_the_pd_launcher_places_prefills_then_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_LYNX_PLATFORM", "cuda")
    pd = PDDeployment("/m", prefills=2, decodes=1, gpus=4, extra_args=["--lynx"], log_dir=Path("/tmp"))
    procs = pd.server_processes()
    assert [(p.name, _gpu_flags(p.argv)) for p in procs] == [
        ("prefill0", ("0", None)), ("prefill1", ("1", None)), ("decode", ("2", None))]
    shared = SingleServer("/m", gpus=1, mem_fraction=0.5, log_dir=Path("/tmp")).server_processes()
    assert _gpu_flags(shared[0].argv) == ("0", "0.5")
    monkeypatch.setenv("SGLANG_LYNX_PLATFORM", "cpu")
    assert all(_gpu_flags(p.argv) == (None, None) for p in PDDeployment("/m", log_dir=Path("/tmp")).server_processes())


def test_the_launcher_dry_run_prints_the_placement(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SGLANG_LYNX_PLATFORM", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert launch_main.main(["pd", "--decode", "2", "--base-gpu-id", "1", "--dry-run", "--", "--lynx"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [_gpu_flags(line.split()) for line in lines] == [("1", None), ("2", None), ("3", None)]
    with pytest.raises(SystemExit):
        launch_main.main(["pd", "--dry-run", "--", "--base-gpu-id", "0"])
