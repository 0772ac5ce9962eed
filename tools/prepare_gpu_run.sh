#!/usr/bin/env bash
# Prepare the carried paths of the GPU check (docs/development.md, "GPU check"), here, where pip
# and the Megatron-LM mirror can be reached; the GPU machine reaches nothing.
#
#   tools/prepare_gpu_run.sh /path/to/NVIDIA/Megatron-LM.git
#
# .gpu_wheels/: megatron-core and numpy at the versions requirements.txt pins, and packaging at
#   the version this checkout's .venv runs (megatron-core's imports; the GPU image's torch and
#   Triton are used as they are), for CPython 3.12 on x86-64.
# .cache/upstream_pr6473/: NVIDIA/Megatron-LM PR #6473's fused e2e-TV modules
#   (tools/fetch_upstream_e2e_tv.py), measured beside 'e2e_tv'. Both folders are git-ignored.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git_dir="${1:?usage: tools/prepare_gpu_run.sh <NVIDIA/Megatron-LM git dir>}"
pin() { grep -E "^$1==" requirements.txt | head -1; }
packaging="packaging==$(.venv/bin/python -c 'import packaging; print(packaging.__version__)')"
rm -rf .gpu_wheels
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels \
    "$(pin megatron-core)" "$(pin numpy)" "$packaging"
.venv/bin/python tools/fetch_upstream_e2e_tv.py --git-dir "$git_dir"
du -sh .gpu_wheels .cache/upstream_pr6473
