"""Pre-import shim that lets stock SGLang run on a host without CUDA.

It runs at interpreter start in every process of the virtual environment (a ``.pth`` file written
by ``install_shim``), because SGLang's scheduler subprocesses import ``sgl_kernel`` before any
plugin is loaded. On a CUDA host it does nothing at all.

On a CPU host it
1. sets ``SGLANG_USE_CPU_ENGINE=1`` (otherwise ``is_cpu()`` is false and rotary embedding reaches
   for vllm) unless the user set it;
2. puts a module object at ``sys.modules["sgl_kernel.load_utils"]`` whose loaders do nothing, so
   ``import sgl_kernel`` (a wheel of CUDA builds only) succeeds with no ops registered and the layers
   take their ``forward_native`` paths.

The SGLang-side half of CPU support (server-argument defaults, the PD paths that assume CUDA)
lives in ``sglang_lynx.integration.platform.cpu_host``.
"""

from __future__ import annotations

import os
import sys
import types

from sglang_lynx.platform.host import is_cpu_host

STUB_MODULE = "sgl_kernel.load_utils"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def make_load_utils_stub() -> types.ModuleType:
    stub = types.ModuleType(STUB_MODULE)
    stub.__doc__ = "sglang-lynx CPU stub: sgl_kernel's CUDA op loaders, made inert."
    stub._load_architecture_specific_ops = lambda *a, **k: None  # type: ignore[attr-defined]
    stub._preload_cuda_library = lambda *a, **k: None  # type: ignore[attr-defined]
    stub._get_compute_capability = lambda *a, **k: None  # type: ignore[attr-defined]
    stub.LYNX_CPU_STUB = True  # type: ignore[attr-defined]
    return stub


def boot(environ: dict[str, str] | None = None, modules: dict[str, object] | None = None) -> bool:
    """Apply the shim if this is a CPU host; return whether it was applied."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    if not is_cpu_host(env):
        return False
    env.setdefault(CPU_ENGINE_ENV, "1")
    if STUB_MODULE not in mods:
        mods[STUB_MODULE] = make_load_utils_stub()
    return True


def shim_active() -> bool:
    """True when the stub is in place in this process."""
    return bool(getattr(sys.modules.get(STUB_MODULE), "LYNX_CPU_STUB", False))
