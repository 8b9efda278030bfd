"""Is this a CUDA host?  A cheap answer usable at interpreter start (no torch import).

``SGLANG_LYNX_PLATFORM=cpu|cuda`` overrides detection; ``auto`` (the default) says CUDA when the
NVIDIA control device exists and ``CUDA_VISIBLE_DEVICES`` does not hide every device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PLATFORM_ENV = "SGLANG_LYNX_PLATFORM"


def detect_platform(environ: Mapping[str, str] | None = None, *, nvidia_ctl: str = "/dev/nvidiactl") -> str:
    """Return ``"cuda"`` or ``"cpu"``."""
    env = os.environ if environ is None else environ
    forced = env.get(PLATFORM_ENV, "auto").strip().lower()
    if forced in ("cpu", "cuda"):
        return forced
    if forced != "auto":
        raise ValueError(f"{PLATFORM_ENV}={forced!r}: expected cpu, cuda or auto")
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    return "cuda" if os.path.exists(nvidia_ctl) else "cpu"


def is_cpu_host(environ: Mapping[str, str] | None = None) -> bool:
    return detect_platform(environ) == "cpu"
