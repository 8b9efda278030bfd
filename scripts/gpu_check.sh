#!/usr/bin/env bash
# The prepared GPU check (issue 17): kernels vs the reference, codec throughput vs a device copy, the
# decode-side math and the pool-layout decode/upgrade, on a bare CUDA machine (torch + triton only).
#   bash scripts/gpu_check.sh OUT_DIR                 # CUDA (default); writes OUT_DIR/gpu_check.json
#   bash scripts/gpu_check.sh OUT_DIR --device cpu    # the same code on the CPU (Triton interpreted, small)
# PYTHON picks the interpreter (default: python3); the whole run is bounded by 8 minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: bash scripts/gpu_check.sh OUT_DIR [--device cuda|cpu] [--small]}"
shift
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
LYNX_COMMIT="${LYNX_COMMIT:-$COMMIT}" exec timeout 480 "$PY" "$ROOT/scripts/gpu_check.py" --out "$OUT" "$@"
