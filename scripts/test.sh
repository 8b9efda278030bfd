#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: lint, types, unit tiers, real Mooncake, real SGLang.
#   bash scripts/test.sh               -> everything
#   bash scripts/test.sh -m "not server"   -> extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
VPY="${LYNX_VENV:-$ROOT/.venv}/bin/python"
echo "[test] ruff"; "$VPY" -m ruff check python kernels tests benchmark
echo "[test] mypy"; "$VPY" -m mypy
set +e
# The Triton kernel tests run in their own interpreter with TRITON_INTERPRET=1 set before anything
# imports triton (SGLang imports it first otherwise, and the interpreter cannot be switched on later).
TRITON_TESTS=(tests/kernels/test_lynx_triton.py tests/kernels/test_lynx_triton_pages.py)
echo "[test] pytest: Triton kernels (TRITON_INTERPRET=1, CPU)"
TRITON_INTERPRET=1 "$VPY" -m pytest -q -ra "${TRITON_TESTS[@]}"
kernels_rc=$?
echo "[test] pytest: everything else"
"$VPY" -m pytest -q -ra --durations=15 "${TRITON_TESTS[@]/#/--ignore=}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
if [ "$rc" = 0 ] && [ "$kernels_rc" != 0 ]; then echo "[test] the Triton kernel tests failed" >&2; exit "$kernels_rc"; fi
exit "$rc"
