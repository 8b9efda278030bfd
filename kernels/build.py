"""Build the CPU fast path of the Lynx codec at set-up: ``python -m sglang_lynx.kernels.build``.

Compiles ``lynx_cpu_fast.c`` into the kernel cache (see ``lynx_cpu_fast``), loads it and checks it
against the torch reference on random pages. Exit status 0 when built and checked, 1 otherwise with a
message that says what to do; without it a server runs the torch reference codec (slower, same bytes)
and says so in its start-up log. Never run on a request.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from sglang_lynx.codec.registry import get_codec


def check_against_reference() -> None:
    """Encode random pages with the fast path and the reference for each codec it serves: same bytes."""
    from sglang_lynx.kernels import lynx_cpu_fast

    x = torch.randn(2 * lynx_cpu_fast.DEFAULT_PARAMS.page_tokens + 7, 2, 64,
                    generator=torch.Generator().manual_seed(0)).bfloat16()
    for name in lynx_cpu_fast.CODEC_NAMES:
        for kind in ("k", "v"):
            got = lynx_cpu_fast.encode(x, kind, codec_name=name)
            want = get_codec(name).encode(x, kind)
            if not (torch.equal(got.anchor, want.anchor) and torch.equal(got.residual, want.residual)):
                raise RuntimeError(f"the built library disagrees with the {name} reference ({kind})")


def main() -> int:
    from sglang_lynx.kernels import lynx_cpu_fast

    start = time.perf_counter()
    try:
        target = lynx_cpu_fast.build()
        lynx_cpu_fast.library()
        check_against_reference()
        from sglang_lynx.kernels import lynx_exact_cpu

        lynx_exact_cpu.build()
        lynx_exact_cpu.library()
    except Exception as exc:
        print(f"[lynx-kernels] the CPU fast path could not be built: {exc}\n[lynx-kernels] servers will use the "
              "torch reference codec (same bytes, slower) and log it at start-up; fix the above and rerun "
              "`python -m sglang_lynx.kernels.build`", file=sys.stderr)
        return 1
    print(f"[lynx-kernels] CPU fast path ready: {target} ({time.perf_counter() - start:.1f} s, checked "
          "against the reference)")
    build_row_gemm()
    build_chain_sdpa()
    return 0


def build_optional(module: Any, what: str, without: str, unavailable: str) -> None:
    """Build one of the verify's kernels (``module``: ``build()``, ``available()``); without it the verify
    computes the same bits the slower way (``without``), so a failure here is a warning. ``unavailable``:
    what a build on a CPU without the kernel's instructions means."""
    try:
        target = module.build()
    except Exception as exc:
        print(f"[lynx-kernels] warning: {what} could not be built ({exc}); {without} (same tokens, slower)",
              file=sys.stderr)
        return
    how = "ready" if module.available() else f"built, but {unavailable}"
    print(f"[lynx-kernels] {what} {how}: {target}")


def build_row_gemm() -> None:
    """The verify's row GEMM kernel (``lynx_rows_gemm``)."""
    from sglang_lynx.kernels import lynx_rows_gemm

    build_optional(lynx_rows_gemm, "the verify's row GEMM kernel", "the verify will run one 1-row GEMM per row",
                   "this CPU lacks AVX512-BF16 (the verify keeps 1-row GEMMs)")


def build_chain_sdpa() -> None:
    """The verify's chain attention kernel (``lynx_chain_sdpa``; whether it matches this host's torch is
    checked by the decode server at start-up)."""
    from sglang_lynx.kernels import lynx_chain_sdpa

    build_optional(lynx_chain_sdpa, "the verify's chain attention kernel",
                   "the verify will run one SDPA call per input", "this CPU lacks AVX-512 (the verify keeps "
                   "one SDPA call per input)")


if __name__ == "__main__":
    sys.exit(main())
