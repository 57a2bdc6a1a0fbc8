#!/usr/bin/env bash
# zen_ds quick start: one DeepSpeed launch that trains a model with a large sparse embedding four
# times in turn, with zen and with DeepSpeed's own gradient reduction, for both kinds of embedding
# gradient; prints progress per step, loss agreement, the per-step communication bytes and
# reduction time of both, why zen picks the scheme it picks, and one closing verdict line.
#
#   bash launch/quickstart.sh                           # 4 ranks, 12 steps, 200k x 64 embedding
#   NPROC=2 STEPS=4 CONFIG=configs/bf16.json bash launch/quickstart.sh
#   CONFIG=configs/pipeline.json bash launch/quickstart.sh   # the PipelineModule example instead
#
# Setup: launch/env.sh finds an environment that runs zen_ds (or creates .venv-quickstart with
# torch's CPU build, DeepSpeed and zen_ds). On a CPU machine ranks talk over gloo; on GPUs the same
# command uses nccl. Exit status: 0 when every zen run succeeded and every stock DeepSpeed run either
# succeeded or stopped on a configuration DeepSpeed does not support (reported as such).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-4}
STEPS=${STEPS:-12}
CONFIG=${CONFIG:-configs/auto.json}
OUT=${OUT:-bench_out/quickstart}
# shellcheck source=launch/env.sh
source launch/env.sh
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
PY=$ZEN_PY
REPORT=(env PYTHONWARNINGS= "$PY" launch/quickstart_report.py)
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.log "$OUT"/verdict-*.txt

# The C++ ops (zen_ds's, and DeepSpeed's shared-memory comm op on CPU) are JIT-built on first use;
# loading them here, once, keeps a first training run from sitting silent while they build. A
# missing cache says a build is coming; a compiler still running after a second is one too (a
# cache left by another checkout or environment).
BUILD_NOTICE="== building zen_ds C++ ops (one time, ~1 min; cached in $TORCH_EXTENSIONS_DIR)"
prepare_ops() {
  local started=$SECONDS announced=0 compiling=0
  if ! ls "$TORCH_EXTENSIONS_DIR"/zen_ds_ops_*/zen_ds_ops_*.so >/dev/null 2>&1 \
     || { [[ "$ZEN_DEVICE" == cpu ]] && ! ls "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/*.so >/dev/null 2>&1; }; then
    echo "$BUILD_NOTICE"; announced=1
  fi
  "$PY" -c "
import sys
from zen_ds.tools.ops_report import main
main(['--build', '--no-color'])
if sys.argv[1] == 'cpu':
    from deepspeed.comm.torch import build_shm_op
    build_shm_op()
" "$ZEN_DEVICE" > "$OUT/build.log" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if pgrep -P "$pid" -x ninja >/dev/null 2>&1; then compiling=$((compiling + 1)); else compiling=0; fi
    if [[ $announced == 0 && $compiling -ge 2 ]]; then echo "$BUILD_NOTICE"; announced=1; fi
    sleep 1
  done
  wait "$pid" || echo "   (loading the ops failed: zen runs its pure-torch ops; see $OUT/build.log)"
  grep -q "pure-torch ops in use" "$OUT/build.log" \
    && echo "   (compiled ops unavailable: zen runs its pure-torch ops; see $OUT/build.log)"
  if [[ $announced == 1 ]]; then echo "== built in $((SECONDS - started)) s"; fi
}
prepare_ops

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

FAILED=0
run() {  # $1 = label, $2 = script, rest = its extra args; 0 ok, 1 failed
  local label=$1 script=$2; shift 2
  echo "== $label: deepspeed --num_gpus $NPROC $script --deepspeed --deepspeed_config $CONFIG $*"
  local started=$SECONDS status=0
  # Rank 0's per-step lines show progress while the run goes; the full log stays in $OUT.
  "$PY" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus "$NPROC" "$script" \
      --deepspeed --deepspeed_config "$CONFIG" --steps "$STEPS" "$@" > "$OUT/$label.log" 2>&1 &
  local pid=$!
  tail -n +1 -F --pid="$pid" "$OUT/$label.log" 2>/dev/null \
    | grep --line-buffered -E "^(\[rank[0-9]+\]: )?(step|zen step|== )|error: " | sed -u 's/^/   /' || true
  wait "$pid" || status=$?
  if [[ $status -ne 0 ]]; then
    echo "   FAILED (exit $status after $((SECONDS - started)) s): $("${REPORT[@]}" error-line "$OUT/$label.log")"
    echo "   full log: $OUT/$label.log"
    return 1
  fi
  echo "   done in $((SECONDS - started)) s"
}

summarize() {  # $1 = embedding grad kind (sparse | dense): both runs' JSON -> summary and verdict
  local zen="$OUT/zen-$1.json" ds="$OUT/deepspeed-$1.json"
  if "$PY" -c "import json, sys; sys.exit(0 if 'error' in json.load(open(sys.argv[1])) else 1)" "$ds"; then
    # A stock failure is fine only where DeepSpeed cannot run this configuration at all.
    "${REPORT[@]}" unsupported "$zen" "$ds" --config "$CONFIG" --verdict "$OUT/verdict-$1.txt" || FAILED=1
  else
    "${REPORT[@]}" compare "$zen" "$ds" --verdict "$OUT/verdict-$1.txt"
  fi
}

if "$PY" -c "import json, sys; sys.exit(0 if 'pipeline' in json.load(open(sys.argv[1])) else 1)" "$CONFIG"; then
  # A pipeline config needs a PipelineModule: run the pipeline example (PP=2 x DP=NPROC/2).
  echo "== $CONFIG is a pipeline config: examples/train_pipeline.py (2 stages, zen vs stock DeepSpeed)"
  run "zen-pipeline" examples/train_pipeline.py || FAILED=1
  run "deepspeed-pipeline" examples/train_pipeline.py --no-zen || FAILED=1
  [[ $FAILED == 0 ]] && echo "verdict: zen and stock DeepSpeed both trained the 2-stage PipelineModule ($CONFIG);" \
      "losses per step above"
else
  # One launch, four runs in turn (each a fresh model and engine): the launcher's and the ranks'
  # start-up paid once. A stock run DeepSpeed cannot do records its error instead of steps.
  run "quickstart" examples/train_embedding.py --out-dir "$OUT" \
      --runs zen-dense,deepspeed-dense,zen-sparse,deepspeed-sparse || FAILED=1
  if [[ $FAILED == 0 ]]; then
    echo "== 1/2: nn.Embedding(sparse=False): dense grads with zero rows (DeepSpeed all-reduces the table)"
    summarize dense
    echo "== 2/2: nn.Embedding(sparse=True): COO grads (DeepSpeed's sparse all-gather)"
    summarize sparse
  fi
  if [[ $FAILED == 0 ]]; then
    echo
    echo "verdict ($NPROC ranks, $CONFIG): $(cat "$OUT/verdict-dense.txt"); $(cat "$OUT/verdict-sparse.txt")"
  fi
fi
if [[ $FAILED != 0 ]]; then
  echo "quick start: a run failed (its error line is above; logs in $OUT)" >&2
  exit 1
fi
