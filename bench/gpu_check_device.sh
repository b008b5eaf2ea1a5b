#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a machine as it comes: its own python3 with torch and
# triton, no venv, no network. Two steps:
#
#   bash bench/gpu_check_device.sh fetch   # where pip reaches PyPI: the wheels that such a
#                                          # machine lacks -> .whl/ (make gpu-wheels)
#   bash bench/gpu_check_device.sh run     # on the GPU machine, .whl/ carried along: install
#                                          # them under /tmp, run the check (make gpu-check)
#
# `run` uses GPU_CHECK_PY if set, else .venv/bin/python if `make install` built it, else
# python3; the package is used from this source tree. Results: $OUT (or bench/out)/
# gpu_check.json and gpu_check.log. Exit status: gpu_check's (0 passed, 1 failed, 2 no GPU).
#
# Settings (environment): GPU_CHECK_PY, WHEEL_DIR (.whl), WHEEL_PYTHON_VERSION (3.12, for
# fetch), GPU_CHECK_SITE (/tmp/site, where run installs the wheels), GPU_CHECK_TIMEOUT_S (515,
# a hard limit on the check), GPU_CHECK_ARGS (extra arguments for bench.gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."

# What bench.gpu_check and tests/test_kernels.py import, transitively, that the lent H200's
# image lacks (/work/.library/device/KINDS.md): services.protocol needs msgspec and
# services.model_loader needs gguf (whose own needs, numpy, pyyaml, requests and tqdm, are
# there). torch, triton, numpy, pytest, safetensors and tokenizers are there. Same versions
# as `make install` resolves.
WHEELS=(msgspec==0.23.0 gguf==0.19.0)
WHEEL_DIR=${WHEEL_DIR:-.whl}

fetch() {
    local version=${WHEEL_PYTHON_VERSION:-3.12}
    mkdir -p "$WHEEL_DIR"
    if [ "$WHEEL_DIR" = .whl ] && git rev-parse --git-dir >/dev/null 2>&1; then
        local exclude
        exclude=$(git rev-parse --git-path info/exclude)
        mkdir -p "$(dirname "$exclude")"
        grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
    fi
    local spec
    for spec in "${WHEELS[@]}"; do  # one version of each: two stop the install there
        find "$WHEEL_DIR" -maxdepth 1 -name "${spec%%==*}-*.whl" ! -name "${spec/==/-}-*" -delete
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$WHEEL_DIR" "${WHEELS[@]}"
    ls -l "$WHEEL_DIR"
    du -sh "$WHEEL_DIR"
}

run() {
    local py=${GPU_CHECK_PY:-}
    if [ -z "$py" ]; then
        if [ -f .venv/.installed ]; then py=.venv/bin/python; else py=python3; fi
    fi
    local out=${OUT:-bench/out}
    mkdir -p "$out"
    if ! "$py" -c 'import torch' 2>/dev/null; then
        echo "gpu-check: $py has no torch; run 'make install' (then .venv is used)" \
            "or set GPU_CHECK_PY to a python with torch and triton" >&2
        return 2
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    if [ "$py" != .venv/bin/python ] && compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
        local site=${GPU_CHECK_SITE:-/tmp/site}
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$WHEEL_DIR"/*.whl
        export PYTHONPATH=$site:$PYTHONPATH
    fi
    echo "gpu-check: $py ($("$py" -c 'import sys; print(sys.version.split()[0])')), PYTHONPATH=$PYTHONPATH"
    command -v nvidia-smi >/dev/null && nvidia-smi -L || true
    set -o pipefail
    local rc=0
    # shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of words
    PYTHONUNBUFFERED=1 timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-515}" \
        "$py" -m bench.gpu_check --out "$out/gpu_check.json" ${GPU_CHECK_ARGS:-} 2>&1 |
        tee "$out/gpu_check.log" || rc=$?
    echo "gpu-check: exit $rc; results in $out/gpu_check.json (add them to bench/RESULTS.md)"
    return "$rc"
}

case ${1:-} in
    fetch) fetch ;;
    run) run ;;
    *)
        echo "usage: bash bench/gpu_check_device.sh fetch|run" >&2
        exit 64
        ;;
esac
