"""Kernel tests: the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on the CPU.

The interpreter is chosen when ``@triton.jit`` runs, so the variable is set here, the kernel module is
(re)imported under it, and it is set only while a kernel test runs: SGLang servers that other tests
start as subprocesses must not inherit it. Every test here is marked ``kernels`` (``-m kernels`` runs them).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


def _interpreted_module() -> ModuleType:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import sglang_lynx.kernels.lynx_triton as lynx_triton

        if not lynx_triton.interpreted():
            importlib.reload(sys.modules["sglang_lynx.kernels.lynx_triton_kernels"])
            lynx_triton = importlib.reload(lynx_triton)
        return lynx_triton
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kernels: kernel-vs-reference tests (Triton interpreter, CPU fast path)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.kernels)


@pytest.fixture(autouse=True)
def _interpret_during_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton reads the variable again when it lazily imports parts of itself during a launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def lynx_triton() -> ModuleType:
    module = _interpreted_module()
    assert module.interpreted()
    return module
