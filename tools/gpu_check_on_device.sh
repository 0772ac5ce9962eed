#!/usr/bin/env bash
# The GPU check as one command on the lent GPU machine (docs/development.md, "GPU check"), after
# tools/prepare_gpu_run.sh here; carry .gpu_wheels and .cache/upstream_pr6473. Everything it
# measures is written to $OUT as it goes (gpu_check.json, gpu_check.md, the log, nvidia-smi,
# wheels.txt: what was installed).
# PYTHON: the interpreter (python3, the GPU image's torch); arguments go to gpu_check.py.
# GPU_CHECK_SITE: where missing wheels go (default /tmp/site, put first on PYTHONPATH).
set -uo pipefail
: "${OUT:?OUT must name the folder that comes back}"
: "${PYTHON:=python3}" "${GPU_CHECK_SITE:=/tmp/site}"
pin() { grep -E "^$1==" requirements.txt | head -1; }
# Only what the image lacks: megatron-core at requirements.txt's pin, and its imports numpy and
# packaging at any version (the image has them; its torch and Triton run the check as they are).
wheels=$("$PYTHON" tools/gpucheck/wheels.py --wheel-dir .gpu_wheels "$(pin megatron-core)" \
    numpy packaging 2>"$OUT/wheels.txt") || { cat "$OUT/wheels.txt" >&2; exit 3; }
if [ -n "$wheels" ]; then
    echo "installing into $GPU_CHECK_SITE:" $wheels | tee -a "$OUT/wheels.txt"
    # shellcheck disable=SC2086  # one wheel path a word
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$GPU_CHECK_SITE" $wheels || exit 3
else
    echo "nothing to install" >>"$OUT/wheels.txt"
fi
export PYTHONPATH="$GPU_CHECK_SITE:$PWD" PYTHONUNBUFFERED=1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# gpu_check starts no benchmark shape after --budget-s; timeout ends a stuck one, and the
# report on disk holds whatever finished before.
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PYTHON" tools/gpu_check.py --out "$OUT" \
    --budget-s "${GPU_CHECK_BUDGET:-330}" "$@" 2>&1 | tee "$OUT/gpu_check.log"
