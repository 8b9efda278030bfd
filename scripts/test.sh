#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: lint, types, unit tiers, real Mooncake, real SGLang.
#   bash scripts/test.sh                   -> everything: the unit tiers and the server tier side by side
#   bash scripts/test.sh -m "not server"   -> extra arguments go to one pytest run of everything else
#   LYNX_TEST_SERIAL=1 bash scripts/test.sh -> everything, one tier after the other
#
# Why side by side: the server tier (real SGLang deployments) spends ~40% of this 2-core machine idle
# (one request at a time, waits on timeouts and heartbeats, server start-ups); the unit tiers (~7 min
# of CPU) fill that. The unit tiers' output is printed after the server tier's.
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
IGNORE_TRITON=("${TRITON_TESTS[@]/#/--ignore=}")

kernel_tests() {
  echo "[test] pytest: Triton kernels (TRITON_INTERPRET=1, CPU)"
  TRITON_INTERPRET=1 "$VPY" -m pytest -q -ra -p no:cacheprovider "${TRITON_TESTS[@]}"
}

if [ "$#" -gt 0 ] || [ "${LYNX_TEST_SERIAL:-0}" = 1 ]; then
  kernel_tests
  kernels_rc=$?
  echo "[test] pytest: everything else"
  "$VPY" -m pytest -q -ra --durations=15 "${IGNORE_TRITON[@]}" "$@"
  rc=$?
  set -e
  if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests" >&2; exit 1; fi
  if [ "$rc" = 0 ] && [ "$kernels_rc" != 0 ]; then echo "[test] the Triton kernel tests failed" >&2; exit "$kernels_rc"; fi
  exit "$rc"
fi

UNIT_LOG="$(mktemp "${TMPDIR:-/tmp}/lynx-unit-tiers.XXXXXX.log")"
# One torch / OpenMP thread in the unit tiers beside the servers: with the default (a thread per core)
# the two tiers oversubscribed the cores (load average ~12 on 2 cores) and a model test ran 13x slower.
(
  export OMP_NUM_THREADS="${LYNX_UNIT_THREADS:-1}"
  kernel_tests; k=$?
  echo "[test] pytest: the unit tiers (not server)"
  "$VPY" -m pytest -q -ra --durations=10 -p no:cacheprovider -m "not server" "${IGNORE_TRITON[@]}"; u=$?
  if [ "$k" != 0 ]; then echo "[test] the Triton kernel tests failed"; exit "$k"; fi
  exit "$u"
) > "$UNIT_LOG" 2>&1 &
UNIT_PID=$!
trap 'kill "$UNIT_PID" 2>/dev/null' EXIT
echo "[test] pytest: the unit tiers run in the background (log: $UNIT_LOG)"
echo "[test] pytest: the server tier (real SGLang deployments)"
"$VPY" -m pytest -q -ra --durations=15 -m server "${IGNORE_TRITON[@]}"
server_rc=$?
wait "$UNIT_PID"
unit_rc=$?
trap - EXIT
echo; echo "[test] ---- the unit tiers ($UNIT_LOG) ----"
cat "$UNIT_LOG"
set -e
echo "[test] server tier: rc $server_rc; unit tiers: rc $unit_rc"
for rc in "$server_rc" "$unit_rc"; do
  if [ "$rc" = 5 ]; then echo "[test] a pytest run collected no tests" >&2; exit 1; fi
done
if [ "$server_rc" != 0 ]; then exit "$server_rc"; fi
exit "$unit_rc"
