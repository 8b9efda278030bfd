#!/bin/bash
# usage: serve.sh PORT TP LOG
cd /work/wt-tp
export PYTHONPATH=/work/wt-tp/python OMP_NUM_THREADS=1
[ "$2" = 2 ] && export SGLANG_CPU_OMP_THREADS_BIND="0|1"
exec /work/main/.venv/bin/python -m sglang.launch_server --model-path ~/.cache/sglang-lynx/models/smollm2-135m --port $1 --tp-size $2 --max-total-tokens 8192 --log-level info > $3 2>&1
