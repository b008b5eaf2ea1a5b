#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a machine as it comes: its own python3 with torch and
# triton, no venv, no network. Three steps:
#
#   bash bench/gpu_check_device.sh fetch     # where pip reaches PyPI: the wheels that such a
#                                            # machine lacks -> .whl/ (make gpu-wheels)
#   bash bench/gpu_check_device.sh dry-run   # here, no GPU: the check's parts 4 and 6 with a
#                                            # tiny model, seeing only the packages that
#                                            # machine will (make gpu-check-dry)
#   bash bench/gpu_check_device.sh run       # on the GPU machine, .whl/ carried along: install
#                                            # them under /tmp, run the check (make gpu-check)
#
# On a lent GPU machine (no network) .whl/ must travel with the tree, an ignored path:
# the device tool's run with carry [".whl"] and command "bash bench/gpu_check_device.sh run"
# (~8-9 minutes: tests <= 120 s, attention ~15 s, the graphs then the eager runner process
# ~1-2 minutes each, NCCL, the server ~3-4 minutes; timeout_s 570). Without .whl/ `run`
# stops in its first seconds with exit status 3 and says so.
#
# A reduced rerun, when the full one ran out of time (the runner's graphs first: issue 31):
#   GPU_CHECK_ARGS="--skip-tests --skip-serve" bash bench/gpu_check_device.sh run
#       # bandwidth, attention, the graphs and eager runner processes, NCCL: ~3 minutes
#   GPU_CHECK_ARGS="--skip-tests --skip-serve --skip-attention --decode-modes graphs" ...
#       # the graphs process alone (its timings and graph_vs_eager): ~1.5 minutes
#   GPU_CHECK_ARGS="--skip-tests --skip-attention" ...   # no tests, the server still runs
#
# `run` uses GPU_CHECK_PY if set, else .venv/bin/python if `make install` built it, else
# python3; the package is used from this source tree. Results: $OUT (or bench/out)/
# gpu_check.json, gpu_check_decode_{graphs,eager}.json (part 4 alone) and gpu_check.log.
# Exit status: gpu_check's (0 passed, 1 failed, 2 no GPU or no torch), 3 when a package from
# WHEELS does not import and $WHEEL_DIR has no wheels (.whl/ not carried or not fetched).
#
# Settings (environment): GPU_CHECK_PY, WHEEL_DIR (.whl), WHEEL_PYTHON_VERSION (3.12, for
# fetch), GPU_CHECK_SITE (/tmp/site, where run installs the wheels), GPU_CHECK_TIMEOUT_S (515,
# a hard limit on the check), GPU_CHECK_ARGS (extra arguments for bench.gpu_check: the
# reduced reruns above, "--tests-timeout-s 90", "--serve-args --enforce-eager"...),
# GPU_CHECK_WHEEL_MODULES (what run imports first to see that the wheels are there),
# GPU_CHECK_KEEP (dry-run: keep its temporary interpreter and links).
set -euo pipefail
cd "$(dirname "$0")/.."

# What bench.gpu_check, tests/test_kernels.py, `actorserve serve` (all five processes) and
# `actorserve bench` import, transitively, that the lent H200's image lacks (IMAGE_PACKAGES
# below): services.protocol needs msgspec, services.model_loader gguf (its own needs, numpy,
# pyyaml, requests and tqdm, are there), the processes' sockets pyzmq, the api_server fastapi
# (with starlette, pydantic, opentelemetry-api and theirs) under uvicorn with httptools.
# typing-extensions and anyio are there, but in versions not known here, and pydantic wants
# typing-extensions >= 4.16, fastapi anyio >= 4.1. Not carried: xgrammar and llguidance
# (structured outputs load them on a request's first grammar), openai (tests). Same versions
# as `make install` resolves; ~5 MB. `dry-run` proves the list: it fails where any process
# of the check imports anything else.
WHEELS=(msgspec==0.23.0 gguf==0.19.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 anyio==4.16.0 opentelemetry-api==1.45.3 uvicorn==0.55.0
    httptools==0.9.0)
# The Python packages of the lent H200's image ('cuda'; /work/.library/device/KINDS.md, read
# there on 2026-11-17): what `dry-run` lets the check see, besides WHEELS.
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc
anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp"
WHEEL_DIR=${WHEEL_DIR:-.whl}
# Modules of WHEELS that the image lacks altogether: `run` imports them before anything else.
WHEEL_MODULES=${GPU_CHECK_WHEEL_MODULES:-msgspec gguf zmq fastapi pydantic uvicorn httptools}

fetch() {
    local version=${WHEEL_PYTHON_VERSION:-3.12}
    mkdir -p "$WHEEL_DIR"
    if [ "$WHEEL_DIR" = .whl ] && git rev-parse --git-dir >/dev/null 2>&1; then
        local exclude
        exclude=$(git rev-parse --git-path info/exclude)
        mkdir -p "$(dirname "$exclude")"
        grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
    fi
    # One version of each and nothing else: two versions, or a stale one, stop the install.
    local keep=() spec name
    for spec in "${WHEELS[@]}"; do
        name=${spec%%==*}
        keep+=("${name//-/_}-${spec##*==}-")
    done
    local f ok
    for f in "$WHEEL_DIR"/*.whl; do
        [ -e "$f" ] || continue
        ok=0
        for spec in "${keep[@]}"; do
            case ${f##*/} in "$spec"*) ok=1 ;; esac
        done
        [ "$ok" = 1 ] || rm -v "$f"
    done
    local platforms=(--python-version "$version" --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64)
    python3 -m pip download -q --no-deps "${platforms[@]}" -d "$WHEEL_DIR" "${WHEELS[@]}"
    # What the machine will do with them (pip install --target), for its Python and platform.
    python3 -m pip install -q --dry-run --no-index --no-deps "${platforms[@]}" \
        --target "$(mktemp -d)" "$WHEEL_DIR"/*.whl
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
    local site=${GPU_CHECK_SITE:-/tmp/site} have_wheels=0
    compgen -G "$WHEEL_DIR/*.whl" >/dev/null && have_wheels=1
    if [ -n "${GPU_CHECK_DRY_SITE:-}" ]; then  # dry-run: WHEELS already there, as .venv has them
        export PYTHONPATH=$GPU_CHECK_DRY_SITE:$PYTHONPATH
    elif [ "$py" != .venv/bin/python ] && [ "$have_wheels" = 1 ]; then
        if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$site" "$WHEEL_DIR"/*.whl; then
            echo "gpu-check: installing $WHEEL_DIR/*.whl for $py failed (above); fetch them" \
                "again for this Python (WHEEL_PYTHON_VERSION=... make gpu-wheels)" >&2
            return 3
        fi
        export PYTHONPATH=$site:$PYTHONPATH
    fi
    # The first seconds: a missing package stops here with what to do, not minutes later.
    local missing
    # shellcheck disable=SC2086  # WHEEL_MODULES is a list of words
    missing=$("$py" - $WHEEL_MODULES <<'PY'
import importlib
import sys

for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError, or a version clash as it loads
        print(f"{name} ({type(e).__name__}: {e})")
PY
) || missing="(the import check itself failed)"
    if [ -n "$missing" ]; then
        echo "gpu-check: $py cannot import:" $missing >&2
        if [ "$have_wheels" = 0 ]; then
            echo "gpu-check: and $WHEEL_DIR/ has no wheels. A lent GPU machine has no network:" \
                "where pip reaches PyPI run 'make gpu-wheels' (bash bench/gpu_check_device.sh" \
                "fetch), then start the device run with carry [\"$WHEEL_DIR\"] (an ignored" \
                "folder only travels when carried)." >&2
        else
            echo "gpu-check: $WHEEL_DIR/ has wheels but they do not provide it: update WHEELS" \
                "in bench/gpu_check_device.sh, then make gpu-wheels" >&2
        fi
        return 3
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

# Here, without a GPU: `run` with --dry-run (parts 4 and 6 of the check with a tiny model on
# the CPU: the runner's plans, the server with its synthetic tokenizer, the bench client, the
# JSON) in an interpreter that sees what the lent machine's will: the image's packages
# (IMAGE_PACKAGES, linked from .venv into a folder a bare venv reads through a .pth file) and
# WHEELS (likewise, on PYTHONPATH as /tmp/site is there), this tree on PYTHONPATH, nothing
# else. A module that any process of the check imports from another package fails here as
# it would there. Not the same as there: .venv's Python (3.11) and its versions of all of it
# (torch for the CPU). Results in $OUT (or bench/out/dry-run).
dry_run() {
    if [ ! -x .venv/bin/python ]; then
        echo "gpu-check dry-run: needs .venv (make install)" >&2
        return 2
    fi
    local tmp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-dry.XXXXXX")
    # shellcheck disable=SC2064  # expand now: tmp is local
    trap "rm -rf '$tmp'" EXIT; [ -z "${GPU_CHECK_KEEP:-}" ] || trap - EXIT
    "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$tmp/py"
    # shellcheck disable=SC2086  # IMAGE_PACKAGES is a list of words
    .venv/bin/python - "$tmp" "${WHEELS[*]}" $IMAGE_PACKAGES <<'PY'
import importlib.metadata as md
import os
import re
import sys

tmp, wheels, image = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
where = {"image": {norm(n) for n in image}, "wheels": {norm(w.split("==")[0]) for w in wheels}}
linked = {"image": set(), "wheels": set()}
for dist in md.distributions():
    name = norm(dist.metadata["Name"])
    for dest in (d for d, names in where.items() if name in names):  # typing-extensions: both
        linked[dest].add(name)
        tops = {p.parts[0] for p in dist.files or [] if p.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            link = os.path.join(tmp, dest, top)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if not top.endswith(".pth") and not os.path.lexists(link):
                os.symlink(dist.locate_file(top), link)
missing = sorted(where["wheels"] - linked["wheels"])
print(f"dry-run: {len(linked['image'])} of .venv's packages as the image's, "
      f"{len(linked['wheels'])} as WHEELS" + (f"; not in .venv: {missing}" if missing else ""))
PY
    local purelib
    purelib=$("$tmp/py/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$tmp/image" >"$purelib/gpu_image.pth"
    # ACTORSERVE_CPU_KERNELS=0: no C++ build of the CPU ops for this interpreter (a GPU run
    # never loads them); torch's own ops instead.
    GPU_CHECK_PY=$tmp/py/bin/python GPU_CHECK_DRY_SITE=$tmp/wheels OUT=${OUT:-bench/out/dry-run} \
        GPU_CHECK_ARGS="--dry-run ${GPU_CHECK_ARGS:-}" ACTORSERVE_CPU_KERNELS=0 run
}

case ${1:-} in
    fetch) fetch ;;
    run) run ;;
    dry-run) dry_run ;;
    *)
        echo "usage: bash bench/gpu_check_device.sh fetch|dry-run|run" >&2
        exit 64
        ;;
esac
