#!/usr/bin/env bash
# The README's test command: set up a fresh virtualenv (torch first: the CPU build, so no
# multi-GB CUDA wheel is pulled), install zen_ds with its test extras, build the C++ ops once,
# and run the whole suite. Re-running reuses the virtualenv and the JIT cache.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${ZEN_DS_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "== creating virtualenv $venv"
    "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if ! python -c "import torch, deepspeed, zen_ds, pytest, xdist, hypothesis, megatron.core, transformers, accelerate" 2>/dev/null; then
    echo "== installing torch (CPU build), then zen_ds[test,megatron,bench,hf]"
    pip install -q "torch==2.13.0"
    pip install -q -e ".[test,megatron,bench,hf]"
fi

# Every rank, launcher and script imports torch and DeepSpeed (and torch._dynamo, sympy,
# transformers, megatron, most of them without byte-code that pip compiled at install): with
# PYTHONDONTWRITEBYTECODE set, as some images do, each of those processes compiles them from source
# again (~30 s of CPU per DeepSpeed rank). Let Python cache the byte-code it compiles.
unset PYTHONDONTWRITEBYTECODE
# JIT-built ops (zen_ds and DeepSpeed's shm_comm) are cached inside the checkout.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/.torch_extensions}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
command_start=$SECONDS
# Two parts, each timed: the unit suite (tests/unit: one process, about a minute) first, then the
# multirank suite (tests/multirank and the README commands: ranks, launchers, builds). Arguments
# go to both; a part they select nothing from is fine, but nothing selected at all is a failure.
# `-m unit` / `-m multirank` run that part only; arguments naming a test path run just those.
unit_part="unit:tests/unit"
multirank_part="multirank:tests/multirank tests/test_readme_commands.py"
parts=("$unit_part" "$multirank_part")
previous=""
for arg in "$@"; do
    if [[ "$previous" == "-m" && "$arg" == "unit" ]]; then
        parts=("$unit_part")
    elif [[ "$previous" == "-m" && "$arg" == "multirank" ]]; then
        parts=("$multirank_part")
    elif [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        parts=("selected:")
        break
    fi
    previous="$arg"
done
# The unit part runs on two pytest-xdist workers (ZEN_DS_TEST_WORKERS; 0 or 1: one process):
# 1m13s -> 39 s here. The multirank part stays in one process: its ranks and launchers already
# fill both cores, and two files at once took as long (22m48s vs 22m58s,
# docs/benchmarks/test_suite_time.md).
workers="${ZEN_DS_TEST_WORKERS:-2}"
xdist_args=()
if [[ "$workers" -gt 1 ]] && python -c "import xdist" 2>/dev/null; then
    xdist_args=(-n "$workers")
fi
# The CUDA builds the multirank part checks (the nvcc compile, the emulated CUDA ops: minutes of
# CPU cold, as in CI) start now, before the build step, in the background at the lowest priority,
# so they use the cores the build step and the tests leave idle (one compiler per op, launchers
# importing, one-process tests); their tests find them done or wait for them
# (tests/support/cuda_builds.py). Only when the whole multirank part runs.
early_build=""
if [[ " ${parts[*]} " == *" $multirank_part "* ]]; then
    setsid nice -n 19 python tests/support/cuda_builds.py > "${TMPDIR:-/tmp}/zen_ds_cuda_builds.log" 2>&1 &
    early_build=$!
    # tests/support/early_runs.py starts the README's launcher lines once these builds are done
    export ZEN_DS_EARLY_BUILD_PID="$early_build"
    # setsid gives it a session of its own, and with the kernel's autogroup scheduling a session
    # competes with the others as a whole whatever its processes' nice: lower the group's too.
    for _ in $(seq 50); do  # once it runs in its own session (else this would renice ours)
        if [[ "$(awk '{print $6}' "/proc/$early_build/stat" 2>/dev/null)" == "$early_build" ]]; then
            echo 19 > "/proc/$early_build/autogroup" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
fi
echo "== building the zen_ds C++ ops and DeepSpeed's shm_comm op (cached after the first run)"
# DeepSpeed JIT-builds its shared-memory comm op (CPU) in the first process that starts its comm
# backend (~50 s of CPU cold); built here, beside zen's ops, instead of inside the first engine test.
python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null 2>&1 &
shm_build=$!
python -m zen_ds report --build || echo "(compiled ops unavailable: the torch fallback is tested)"
wait "$shm_build" || echo "(DeepSpeed's shm_comm op did not build here: its first engine builds it)"
build_seconds=$((SECONDS - command_start))
overall=0
ran=0
summary="$(printf 'build step: %dm%02ds' $((build_seconds / 60)) $((build_seconds % 60)))"$'\n'
# The machine's busy CPU time (all processes, from /proc/stat) over a part: how much of the
# cores the part kept busy, i.e. whether it is bound by CPU or by waiting.
cpu_busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat 2>/dev/null || echo 0; }
for part in "${parts[@]}"; do
    name="${part%%:*}"
    read -r -a paths <<< "${part#*:}"
    echo "== $name tests"
    start=$SECONDS
    busy_start=$(cpu_busy_ticks)
    set +e
    part_args=()
    if [[ "$name" == "unit" ]]; then
        part_args=("${xdist_args[@]}")
    fi
    python -m pytest "${paths[@]}" "${part_args[@]}" --durations=15 "$@"
    status=$?
    set -e
    elapsed=$((SECONDS - start))
    busy=$(( ($(cpu_busy_ticks) - busy_start) / $(getconf CLK_TCK) ))
    summary+="$(printf '%s tests: %dm%02ds (pytest exit %d; CPU busy %dm%02ds on %d cores)' "$name" \
        $((elapsed / 60)) $((elapsed % 60)) "$status" $((busy / 60)) $((busy % 60)) "$(getconf _NPROCESSORS_ONLN)")"$'\n'
    if [ "$status" -eq 5 ]; then
        continue  # this part selected nothing
    fi
    ran=1
    if [ "$status" -ne 0 ]; then
        overall=$status
    fi
done
if [[ -n "$early_build" ]] && kill -0 "$early_build" 2>/dev/null; then
    kill -- -"$early_build" 2>/dev/null || true  # a filtered run did not need them all
fi
total=$((SECONDS - command_start))
summary+="$(printf 'in all (build and both parts): %dm%02ds' $((total / 60)) $((total % 60)))"$'\n'
echo "== times"
printf '%s' "$summary"
if [ "$ran" -eq 0 ]; then
    echo "pytest collected no tests: treat as a failure (check the -k/-m filter or the tests folder)"
    exit 1
fi
exit "$overall"
