#!/usr/bin/env bash
# trainguard's one entry point for set-up. Usage:
#   ./run.sh demo            create .venv if needed, then run `trainguard demo`
#   ./run.sh test [ARGS]     create .venv if needed, then run the test suite (pytest ARGS)
#   ./run.sh <cmd> [ARGS]    create .venv if needed, then run `trainguard <cmd> ARGS`
# On a machine without an NVIDIA GPU it installs torch's CPU build (never a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${TRAINGUARD_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0

setup() {
    local stamp="$VENV/.trainguard-ready"
    if [[ -f "$stamp" && "$stamp" -nt pyproject.toml && "$stamp" -nt run.sh && "$stamp" -nt constraints.txt ]]; then return 0; fi
    echo "[run.sh] setting up $VENV (first run only)..." >&2
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    # (--no-compile: byte-compiled below on every core at once; pip compiles one file at a time: over half its time)
    local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "${pip[@]}" "torch==$TORCH_VERSION"
        else
            # CPU build: a local wheel where the machine has one, else PyTorch's CPU index.
            "${pip[@]}" "torch==$TORCH_VERSION" 2>/dev/null \
                || "${pip[@]}" "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
    # every dependency at the version the suite passed with (constraints.txt); torch is already in place
    "${pip[@]}" -c constraints.txt -e ".[dev]"
    # Byte-compile the installed packages and trainguard once: where PYTHONDONTWRITEBYTECODE is set, nothing is
    # cached at import, and every process of the suite would compile what it imports again. (A file that does not
    # compile, a template say, is compiled at import as before: its failure is not an error here.)
    local dirs
    mapfile -t dirs < <("$VENV/bin/python" -c "import sysconfig; print(*sorted({sysconfig.get_paths()[k] for k in ('purelib', 'platlib')}), sep='\n')")
    "$VENV/bin/python" -m compileall -q -j 0 "${dirs[@]}" trainguard >/dev/null 2>&1 || true
    setup_simgrid || echo "[run.sh] SimGrid not available: the time-to-train simulation uses its built-in event loop" >&2
    setup_tcmalloc || echo "[run.sh] tcmalloc not installed: the test of host memory under a preloaded allocator skips" >&2
    touch "$stamp"
}

# SimGrid's Python binding comes from Debian (PyPI has source only). Expose just that module to the
# venv through a .pth file, so Debian's other packages (numpy, ...) never shadow the venv's.
setup_simgrid() {
    local so
    so=$(ls /usr/lib/python3/dist-packages/simgrid*.so 2>/dev/null | head -n1 || true)
    if [[ -z "$so" && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        (apt-get install -y -qq python3-simgrid >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq python3-simgrid >/dev/null 2>&1; }) || return 1
        so=$(ls /usr/lib/python3/dist-packages/simgrid*.so 2>/dev/null | head -n1 || true)
    fi
    [[ -n "$so" ]] || return 1
    local dir="$VENV/simgrid-binding"
    mkdir -p "$dir" && ln -sf "$so" "$dir/"
    local site
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$(cd "$dir" && pwd)" > "$site/trainguard-simgrid.pth"
    "$VENV/bin/python" -c "import simgrid" 2>/dev/null
}

# A malloc to preload (LD_PRELOAD), for the test that host_memory neither tunes nor measures glibc's heap when
# another allocator serves the process. Best effort, as root only; nothing preloads it by default.
setup_tcmalloc() {
    ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && return 0
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || return 1
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }
}

setup
cmd=${1:-demo}
[[ $# -gt 0 ]] && shift
case "$cmd" in
    test) exec "$VENV/bin/python" -m pytest -n 2 --dist loadgroup "$@" ;;
    *) exec "$VENV/bin/trainguard" "$cmd" "$@" ;;
esac
