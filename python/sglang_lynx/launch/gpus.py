"""Which GPUs each server of a one-host PD deployment gets (CUDA hosts; nothing on a CPU host).

SGLang places a server's tensor-parallel ranks on GPUs ``--base-gpu-id B`` .. ``B + tp - 1`` (with
the default ``--gpu-id-step 1``); left alone, every server of a PD pair starts on GPU 0. The launcher
(``launch.deployment``) therefore gives server ``i`` (prefills first, then decodes) its own contiguous
range, starting at the launcher's ``--base-gpu-id`` (default 0):

    server i  ->  --base-gpu-id  base + i * tp        (GPUs base + i*tp .. base + (i+1)*tp - 1)

and ``--mem-fraction-static`` when asked for (``--mem-fraction``; otherwise SGLang sizes its pool for a
GPU it has alone). A host with too few GPUs for that: servers with ``tp = 1`` share them round-robin
and each gets ``SHARED_MEMORY_BUDGET / servers-on-its-GPU`` of the GPU memory (or ``--mem-fraction``
if it fits in the budget); with ``tp > 1`` it is refused, naming how many GPUs are needed.

The GPU count comes from ``CUDA_VISIBLE_DEVICES`` when set, else the ``/dev/nvidiaN`` device files:
no CUDA initialisation in the launcher. Nothing here has run on a GPU host (none was lent); the
assignment is unit-tested (``tests/foundation/test_launch_gpus.py``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SHARED_MEMORY_BUDGET = 0.8  # fraction of one GPU's memory the servers sharing it may take together
MAX_SHARED_TOTAL = 0.95  # a user --mem-fraction times servers per GPU above this is refused
OWNED_FLAGS = ("--base-gpu-id", "--mem-fraction-static", "--gpu-id-step")
_TP_FLAGS = ("--tp-size", "--tensor-parallel-size")


class GpuPlacementError(ValueError):
    """The deployment does not fit the host's GPUs, or the flags fight the launcher's placement."""


@dataclass(frozen=True)
class Placement:
    """One server's GPUs: ``tp_size`` GPUs from ``base_gpu_id``; ``mem_fraction`` None = SGLang's default."""

    name: str
    base_gpu_id: int
    tp_size: int
    mem_fraction: float | None

    @property
    def gpus(self) -> list[int]:
        return list(range(self.base_gpu_id, self.base_gpu_id + self.tp_size))

    def argv(self) -> list[str]:
        args = ["--base-gpu-id", str(self.base_gpu_id)]
        if self.mem_fraction is not None:
            args += ["--mem-fraction-static", f"{self.mem_fraction:g}"]
        return args


def visible_gpus(environ: Mapping[str, str] | None = None, dev_dir: str = "/dev") -> int:
    """How many GPUs SGLang will see: ``CUDA_VISIBLE_DEVICES`` entries, else ``/dev/nvidiaN`` files."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip() and e.strip() != "-1"]
        return len(entries)
    return sum(1 for p in Path(dev_dir).glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--flag V`` or ``--flag=V``), None if absent."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def tp_size_of(args: Sequence[str]) -> int:
    value = flag_value(args, _TP_FLAGS)
    if value is None:
        return 1
    try:
        tp = int(value)
    except ValueError as exc:
        raise GpuPlacementError(f"--tp-size {value!r}: not an integer") from exc
    if tp < 1:
        raise GpuPlacementError(f"--tp-size {tp}: must be >= 1")
    return tp


def check_not_owned(args: Sequence[str]) -> None:
    """The launcher sets these per server: the same value for every server would put them together."""
    for flag in OWNED_FLAGS:
        if flag_value(args, [flag]) is not None:
            raise GpuPlacementError(
                f"{flag} after '--' would give every server the same GPUs; the launcher places each server "
                "on its own GPUs: use the launcher's --base-gpu-id (first GPU) and --mem-fraction instead")


def place_servers(names: Sequence[str], tp_size: int, gpus: int, base_gpu_id: int = 0,
                  mem_fraction: float | None = None) -> list[Placement]:
    """The placement of ``names`` (in order) on GPUs ``base_gpu_id .. gpus - 1`` (module docstring)."""
    if tp_size < 1:
        raise GpuPlacementError(f"--tp-size {tp_size}: must be >= 1")
    if base_gpu_id < 0:
        raise GpuPlacementError(f"--base-gpu-id {base_gpu_id}: must be >= 0")
    if mem_fraction is not None and not 0.0 < mem_fraction < 1.0:
        raise GpuPlacementError(f"--mem-fraction {mem_fraction}: must be in (0, 1)")
    available = gpus - base_gpu_id
    needed = len(names) * tp_size
    if available <= 0:
        raise GpuPlacementError(f"--base-gpu-id {base_gpu_id}: the host shows {gpus} GPU(s) (0 .. {gpus - 1})")
    if needed <= available:
        return [Placement(name, base_gpu_id + i * tp_size, tp_size, mem_fraction) for i, name in enumerate(names)]
    if tp_size > 1:
        raise GpuPlacementError(
            f"{len(names)} servers x --tp-size {tp_size} need {needed} GPUs from GPU {base_gpu_id}; the host shows "
            f"{available} from there: start fewer servers or a smaller --tp-size")
    per_gpu = math.ceil(len(names) / available)
    if mem_fraction is None:
        mem_fraction = math.floor(100 * SHARED_MEMORY_BUDGET / per_gpu) / 100
    elif mem_fraction * per_gpu > MAX_SHARED_TOTAL:
        raise GpuPlacementError(
            f"--mem-fraction {mem_fraction}: {per_gpu} servers share a GPU here, together "
            f"{mem_fraction * per_gpu:.2f} of its memory (at most {MAX_SHARED_TOTAL}); pass at most "
            f"{MAX_SHARED_TOTAL / per_gpu:.2f}")
    return [Placement(name, base_gpu_id + i % available, 1, mem_fraction) for i, name in enumerate(names)]
