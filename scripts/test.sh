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
echo "[test] pytest"
set +e
"$VPY" -m pytest -q -ra --durations=15 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
exit "$rc"
