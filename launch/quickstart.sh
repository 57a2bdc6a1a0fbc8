#!/usr/bin/env bash
# zen_ds quick start: one 4-rank DeepSpeed training of a model with a large sparse embedding, run
# once with zen and once with DeepSpeed's own gradient reduction; prints loss agreement and the
# per-step communication bytes and reduction time of both.
#
#   bash launch/quickstart.sh                 # defaults: 4 ranks, 12 steps, 200k x 64 embedding
#   NPROC=2 STEPS=10 bash launch/quickstart.sh
#
# Setup: uses the current python if it already imports torch, deepspeed and zen_ds; otherwise it
# creates .venv-quickstart and installs torch (CPU build), then zen_ds with its dependencies.
# On a CPU machine ranks talk over gloo; on GPUs the same command uses nccl.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-4}
STEPS=${STEPS:-12}
CONFIG=${CONFIG:-configs/auto.json}
OUT=${OUT:-bench_out/quickstart}
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch, deepspeed, zen_ds" >/dev/null 2>&1; then
  echo "== setting up .venv-quickstart (torch CPU build, deepspeed, zen_ds)"
  [ -x .venv-quickstart/bin/python ] || "$PY" -m venv .venv-quickstart
  PY=.venv-quickstart/bin/python
  "$PY" -m pip install -q --upgrade pip
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e .
fi
DS_LAUNCH=("$PY" -m deepspeed.launcher.runner)
mkdir -p "$OUT"
free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

run() {  # $1 = label, rest = extra args
  local label=$1; shift
  echo "== $label: deepspeed --num_gpus $NPROC examples/train_embedding.py --deepspeed --deepspeed_config $CONFIG $*"
  "${DS_LAUNCH[@]}" --master_port "$(free_port)" --num_gpus "$NPROC" examples/train_embedding.py \
      --deepspeed --deepspeed_config "$CONFIG" --steps "$STEPS" --out "$OUT/$label.json" "$@" \
      > "$OUT/$label.log" 2>&1 || { tail -40 "$OUT/$label.log"; exit 1; }
  grep -E "^step|zen step" "$OUT/$label.log" | tail -5
}
compare() {  # $1 = embedding grad kind (sparse | dense)
run "zen-$1" --embedding-grad "$1"
run "deepspeed-$1" --no-zen --embedding-grad "$1"
"$PY" - "$OUT/zen-$1.json" "$OUT/deepspeed-$1.json" <<'PYEOF'
import json, statistics, sys
zen, ds = (json.load(open(p)) for p in sys.argv[1:3])
zr, dr = zen["records"][1:], ds["records"][1:]  # step 0 includes one-time op loading
lz, ld = [r["loss"] for r in zen["records"]], [r["loss"] for r in ds["records"]]
worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lz, ld))
med = lambda rs, k: statistics.median(r[k] for r in rs)
kind = "sparse=True" if zen.get("embedding_grad", "sparse") == "sparse" else "sparse=False, dense grads"
print(f"\nmodel: embedding {zen['vocab']} x {zen['hidden']} ({kind}, "
      f"{zen['embed_dense_bytes'] / 1e6:.1f} MB) + MLP; {zen['world']} ranks, micro-batch "
      f"{zen['micro_batch']} x {zen['context']} Zipf ids; medians over steps 1..{len(zen['records']) - 1}")
print(f"loss agreement: max relative difference over {len(lz)} steps = {worst:.2e} "
      f"(final loss zen {lz[-1]:.6f}, deepspeed {ld[-1]:.6f})")
print(f"{'':12s}{'embedding bytes sent/rank':>28s}{'MLP bytes sent/rank':>22s}{'reduction time':>18s}")
for name, rs in (("zen", zr), ("deepspeed", dr)):
    print(f"{name:12s}{med(rs, 'embed_bytes_sent'):>28,.0f}{med(rs, 'dense_bytes_sent'):>22,.0f}"
          f"{1e3 * med(rs, 'seconds'):>15.2f} ms")
print(f"zen schemes chosen: {sorted(set(r['scheme'] for r in zr))}; embedding bytes zen/deepspeed = "
      f"{med(zr, 'embed_bytes_sent') / med(dr, 'embed_bytes_sent'):.3f}")
print("(bytes: zen = exact SyncStats per rank incl. handshake; deepspeed = its sparse all-gather "
      "(n-1) x (8 + max_nnz x (8 + 4 x hidden)) for sparse=True, its ring all-reduce of the whole table "
      "2(n-1)/n x size for dense grads; MLP = ring all-reduce 2(n-1)/n x size, both runs)")
PYEOF
}
echo "== 1/2: nn.Embedding(sparse=False): dense grads with zero rows (DeepSpeed all-reduces the table)"
compare dense
echo "== 2/2: nn.Embedding(sparse=True): COO grads (DeepSpeed's sparse all-gather)"
compare sparse
