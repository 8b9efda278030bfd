"""How long the lynx Triton kernels take to compile for a GPU, measured without one (issue 17).

A GPU server compiles each kernel at its first launch with the KV width ``HD = heads x head_dim`` of
its model (a constexpr), inside the first request's encode or decode: a slow compile is a stall of that
request. The first H200 run of ``scripts/gpu_check.py`` found the key encode kernel in ``ptxas`` for
36 s at HD = 512 (``results/gpu-h200-2026-12-04``). Triton compiles ahead of time for a named target
with the ``ptxas`` its wheel carries, so this runs on a CPU host: each kernel, for each HD and each
key-kernel tile width (``pairs_per_program``; the widest, ``>= HD / 2``, is the whole-width tile the
kernels had before), for sm_90 (H100 / H200) by default.

    python benchmark/kernels/bench_compile_time.py --hd 128 512 1024 --pairs 64 4096 \\
        --out benchmark/kernels/results/compile-sm90.json

The compile times depend on the triton version (its ptxas): the JSON records it; run it under the
triton the GPU machine has (``PYTHONPATH=<a triton 3.6 install>`` for the device image) to see theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PTR = {"x_ptr": "*bf16", "anchor_ptr": "*u8", "residual_ptr": "*u8", "peak_ptr": "*fp32", "pool_ptr": "*i16",
       "slot_ptr": "*i64"}
FLOATS = ("alpha", "log1p_alpha")


def _signature(fn, constexprs: dict[str, object]) -> tuple[dict[str, str], dict[tuple[int], object]]:  # noqa: ANN001
    names = list(fn.arg_names)
    signature = {}
    for name in names:
        signature[name] = "constexpr" if name in constexprs else PTR.get(name, "fp32" if name in FLOATS else "i32")
    return signature, {(names.index(k),): v for k, v in constexprs.items()}


def compile_seconds(fn, constexprs: dict[str, object], arch: int) -> float:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants = _signature(fn, constexprs)
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    started = time.perf_counter()
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False})
    return time.perf_counter() - started


def kernel_cases(hd: int, pairs: int) -> dict[str, tuple[object, dict[str, object]]]:
    """The four kernels with the constexprs the wrappers launch them with (default layout, bf16 pool)."""
    from sglang_lynx.kernels import lynx_triton as lt
    from sglang_lynx.kernels import lynx_triton_kernels as K

    from sglang_lynx.codec.layout import LayoutParams, key_chunk
    from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD

    params = LayoutParams()
    chunk = key_chunk(params, KEY_CHUNK_FIELD)
    group = min(params.value_group_size, 128)
    block_half, _ = lt._pair_blocks(hd, pairs)
    keys = dict(P=params.page_tokens, C=chunk, HD=hd, BLOCK_C=lt._p2(chunk), BLOCK_HALF=block_half, COMPAND=False)
    values = dict(P=params.page_tokens, G=group, HD=hd, BLOCK_R=64, BLOCK_G2=lt._p2(group // 2), COMPAND=False)
    decode = dict(HAS_RES=True, POOL_BF16=True)
    return {
        "encode_keys": (K.encode_keys_kernel, {**keys, "S": params.sink_tokens}),
        "decode_keys": (K.decode_keys_kernel, {**keys, **decode}),
        "encode_values": (K.encode_values_kernel, values),
        "decode_values": (K.decode_values_kernel, {**values, **decode}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hd", type=int, nargs="+", default=[128, 512, 1024], help="heads x head_dim values")
    parser.add_argument("--pairs", type=int, nargs="+", default=[64, 4096],
                        help="key-kernel pairs_per_program values (4096: the whole width up to HD 8192)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: Hopper)")
    parser.add_argument("--out", type=Path, help="JSON result file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "python"))
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="lynx-triton-cache-")  # every compile is a miss
    import triton

    rows, seen = [], set()
    for hd in args.hd:
        for pairs in args.pairs:
            for name, (fn, constexprs) in kernel_cases(hd, pairs).items():
                key = (name, tuple(sorted(constexprs.items())))
                if key in seen:
                    continue  # the value kernels do not depend on pairs_per_program; a cap above HD / 2 neither
                seen.add(key)
                seconds = compile_seconds(fn, constexprs, args.arch)
                rows.append({"kernel": name, "hd": hd, "pairs_per_program": pairs if "keys" in name else None,
                             "block_half": constexprs.get("BLOCK_HALF"), "seconds": round(seconds, 2)})
                print(f"{name:14s} HD {hd:5d}  tile pairs {rows[-1]['block_half'] or '-':>5}  "
                      f"{seconds:7.2f} s", flush=True)
    if args.out:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "benchmark/kernels/bench_compile_time.py", *(argv or sys.argv[1:])]),
            "commit": commit, "triton": triton.__version__, "arch": args.arch, "host": platform.node(),
            "processor": platform.processor() or platform.machine(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
