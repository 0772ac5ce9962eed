#!/usr/bin/env bash
# The GPU check as one command on the lent GPU machine (docs/development.md, "GPU check"), after
# tools/prepare_gpu_run.sh here; carry .gpu_wheels and .cache/upstream_pr6473. Everything it
# measures is written to $OUT as it goes (gpu_check.json, gpu_check.md, the log, nvidia-smi).
# PYTHON: the interpreter (python3, the GPU image's torch); arguments go to gpu_check.py.
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
"${PYTHON:=python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu_wheels/*.whl || exit 3
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# gpu_check starts no benchmark shape after --budget-s; timeout ends a stuck one, and the
# report on disk holds whatever finished before.
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PYTHON" tools/gpu_check.py --out "$OUT" \
    --budget-s "${GPU_CHECK_BUDGET:-330}" "$@" 2>&1 | tee "$OUT/gpu_check.log"
