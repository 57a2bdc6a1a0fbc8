#!/usr/bin/env bash
# The prepared GPU check (see launch/gpu_check.py for what it runs and writes).
#
#   launch/gpu_check.sh --prepare          # here, with network or a local index: build the wheels
#                                          # into launch/gpu_wheels/ (not committed)
#   launch/gpu_check.sh [--out DIR] [--budget SECONDS]
#                                          # on the GPU machine (no network): install DeepSpeed and
#                                          # zen_ds from launch/gpu_wheels/ next to the machine's
#                                          # torch, then run the check (<= 8 minutes)
#
# Without a GPU it exits 2 within seconds, printing "no CUDA device", before installing anything.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
WHEELS="${ZEN_GPU_WHEELS:-$HERE/gpu_wheels}"
PY="${PYTHON:-python3}"
DEEPSPEED_VERSION="${DEEPSPEED_VERSION:-0.19.8}"
# DeepSpeed's and the check's run-time requirements that a bare torch install may lack, as wheels
# for the GPU machine's Python (3.12 unless ZEN_GPU_PYTHON_VERSION says otherwise).
RUNTIME_DEPS=(hjson py-cpuinfo msgpack ninja psutil einops tqdm packaging pydantic pydantic-core
              annotated-types typing-inspection typing-extensions numpy pytest pluggy iniconfig)

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$WHEELS"
    echo "[gpu_check] zen_ds wheel (with the op sources) -> $WHEELS"
    # PEP 517 build isolation: pip brings the setuptools/wheel the build needs (a plain python3 may
    # have neither; the op sources need no torch at build time)
    "$PY" -m pip wheel --no-deps -q -w "$WHEELS" "$REPO"
    echo "[gpu_check] deepspeed==$DEEPSPEED_VERSION -> $WHEELS"
    "$PY" -m pip download --no-deps -q -d "$WHEELS" "deepspeed==$DEEPSPEED_VERSION"
    for sdist in "$WHEELS"/deepspeed-"$DEEPSPEED_VERSION".tar.gz; do
        [[ -f "$sdist" ]] || continue
        # a pure-python wheel (no prebuilt DeepSpeed ops), so the GPU machine builds nothing
        DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps -q -w "$WHEELS" "$sdist"
        rm -f "$sdist"
    done
    echo "[gpu_check] run-time requirements for Python ${ZEN_GPU_PYTHON_VERSION:-3.12} -> $WHEELS"
    "$PY" -m pip download -q -d "$WHEELS" --only-binary=:all: \
        --python-version "${ZEN_GPU_PYTHON_VERSION:-3.12}" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any "${RUNTIME_DEPS[@]}" || {
        echo "[gpu_check] warning: some run-time requirements could not be downloaded;" \
             "the GPU machine must already have them" >&2; }
    ls -1 "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

cd "$REPO"
# No GPU: fail fast, before installing anything. Without a GPU device node (as in launch/env.sh)
# the answer needs no torch import (seconds on a small CPU machine); otherwise torch decides.
if ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && [[ ! -e /dev/dxg ]]; then
    echo "gpu_check: no CUDA device (no /dev/nvidia* or /dev/dxg device node); nothing was run" >&2
    exit 2
fi
"$PY" "$HERE/gpu_check.py" --probe

if ! "$PY" -c "import deepspeed, zen_ds" >/dev/null 2>&1; then
    [[ -d "$WHEELS" ]] || { echo "[gpu_check] $WHEELS is missing: run launch/gpu_check.sh --prepare first" >&2; exit 3; }
    # The machine's torch may live in a venv of its own (a new venv, even with
    # --system-site-packages, would not see it), so install next to it with --target: DeepSpeed,
    # zen_ds and whichever of their requirements this Python lacks, without dependency
    # resolution (it would look for a torch wheel).
    TARGET="${ZEN_GPU_CHECK_SITE:-/tmp/zen_gpu_check_site}"
    MISSING=$("$PY" - "$WHEELS" <<'PYEOF'
import importlib.metadata as md, pathlib, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        md.version(name)
        if name not in ("deepspeed", "zen_ds"):
            continue
    except md.PackageNotFoundError:
        pass
    print(wheel)
PYEOF
)
    # shellcheck disable=SC2086
    "$PY" -m pip install --isolated --no-index --no-deps --no-compile -q --target "$TARGET" $MISSING
    export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.torch_extensions}"
exec "$PY" "$HERE/gpu_check.py" "$@"
