#!/usr/bin/env bash
# Prepare the carried paths of the GPU check (docs/development.md, "GPU check"), here, where pip
# and the Megatron-LM mirror can be reached; the GPU machine reaches nothing.
#
#   tools/prepare_gpu_run.sh /path/to/NVIDIA/Megatron-LM.git
#   GPU_EXTRA_WHEELS="numpy" tools/prepare_gpu_run.sh ...   # for an image that lacks numpy
#
# .gpu_wheels/: megatron-core at the version requirements.txt pins (the one place versions are
#   pinned), for CPython 3.12 on x86-64. The device image has torch, Triton, numpy and packaging,
#   megatron-core's other imports, and tools/gpu_check_on_device.sh installs only what it lacks
#   (tools/gpucheck/wheels.py); GPU_EXTRA_WHEELS names more distributions to carry, each at its
#   requirements.txt pin, else at the version this checkout's .venv runs.
# .cache/upstream_pr6473/: NVIDIA/Megatron-LM PR #6473's fused e2e-TV modules
#   (tools/fetch_upstream_e2e_tv.py), measured and compared beside 'e2e_tv'. Both folders are
#   git-ignored.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git_dir="${1:?usage: tools/prepare_gpu_run.sh <NVIDIA/Megatron-LM git dir>}"
pin() { grep -E "^$1==" requirements.txt | head -1; }
# requirements.txt's pin, else the version the .venv runs (packaging is not pinned there).
pinned() {
    pin "$1" || echo "$1==$(.venv/bin/python -c \
        "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1")"
}
wanted=("$(pin megatron-core)")
for name in ${GPU_EXTRA_WHEELS:-}; do wanted+=("$(pinned "$name")"); done
rm -rf .gpu_wheels
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels "${wanted[@]}"
.venv/bin/python tools/fetch_upstream_e2e_tv.py --git-dir "$git_dir"
du -sh .gpu_wheels .cache/upstream_pr6473
