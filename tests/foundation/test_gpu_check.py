"""``scripts/gpu_check.sh`` runs, end to end, on the CPU (issue 17): the same code a CUDA machine runs,
with the Triton kernels interpreted, small sizes and only the bare machine's packages importable, so the
one-command GPU check is known to work (and to import neither SGLang nor Mooncake) before a GPU sees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What the bare CUDA machine's python has beside the standard library (import names of the packages its
# image lists, ../.library/device/KINDS.md, that torch and triton use): an import of anything else by the
# check fails, as it would there. Imports made at interpreter start (this venv's .pth files) are not seen.
BARE_MACHINE_PACKAGES = ("torch", "torchgen", "functorch", "triton", "numpy", "sympy", "mpmath", "networkx",
                         "jinja2", "markupsafe", "filelock", "fsspec", "typing_extensions", "tqdm", "pynvml",
                         "cuda", "nvidia", "packaging", "setuptools", "pkg_resources", "yaml", "psutil",
                         "sglang_lynx")
BARE_IMPORTS = f"""
import importlib.abc, sys
ALLOWED = set(sys.stdlib_module_names) | {set(BARE_MACHINE_PACKAGES)!r}
class BareMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in ALLOWED and not top.startswith("_"):
            raise ModuleNotFoundError(f"{{name}} is not on the bare CUDA machine", name=name)
        return None
sys.meta_path.insert(0, BareMachine())
"""


@pytest.mark.timeout(900)
def test_the_gpu_check_passes_on_the_cpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHON"] = sys.executable
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BARE_IMPORTS)
    env["PYTHONPATH"] = str(tmp_path / "site")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--device", "cpu"],
                         env=env, capture_output=True, text=True, timeout=840)
    assert (tmp_path / "out" / "gpu_check.json").is_file(), run.stdout + run.stderr
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    failed = {part: result[part] for part in ("kernels", "decode_math", "pool_layout", "throughput")
              if not result[part]["passed"]}
    assert failed == {}, failed
    assert result["imported_sglang_or_mooncake"] == []
    assert result["passed"] and run.returncode == 0 and result["small"] and result["device"] == "cpu"
    assert result["kernels"]["cases"] >= 12 and result["decode_math"]["greedy_mismatches"] == 0
    assert result["pool_layout"]["kernels"] == {"anchor_only_equal": True, "upgrade_equal": True}
    assert set(result["throughput"]["fraction_of_copy"]) == {
        f"{op}_{kind}" for op in ("encode", "decode_anchor", "decode_full") for kind in ("k", "v")}
