#!/usr/bin/env bash
# Design-space runs on the emulated cluster (BENCHMARKS.md "Design space"):
# per topology, `zen-bench calibrate` measures latency, bandwidth, duplex and compute rates,
# then `zen-bench sync` runs all six schemes and auto with that cost model, taking turns every
# round (--interleave) so drift falls on all alike. Needs root (network
# namespaces, tc). Results: bench_out/design_{h4,h4x2,h8}.{json,txt}, bench_out/cal_*.txt.
#   RATE=200mbit ITERS=3 TAG=_200m bash launch/design_space_runs.sh h4 h4x2 h8
#   RATE=100mbit ITERS=3 TAG=_100m SCALE=0.03125 NOCHECK=1 bash launch/design_space_runs.sh h16
# picks the link rate, the iterations and a suffix for the file names; the arguments name the
# topologies (hH = H hosts of one rank, hHxK = H hosts of K ranks; default h4 h4x2 h8). SCALE
# shrinks the workloads and NOCHECK=1 skips the dense reference check (16 ranks' dense
# references do not fit in 24 GiB at the default scale).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p bench_out
export TORCH_EXTENSIONS_DIR=$PWD/.torch_extensions OMP_NUM_THREADS=1
RATE=${RATE:-1gbit}
ITERS=${ITERS:-5}
TAG=${TAG:-}
EXTRA=()
[[ -n "${SCALE:-}" ]] && EXTRA+=(--scale "$SCALE")
[[ "${NOCHECK:-0}" == 1 ]] && EXTRA+=(--no-check)
WL="-w lstm -w topk1 -w synthetic:rows=2000,width=16,density=0.01,overlap=0.5,skew=1.0 -w synthetic:rows=400000,width=64,density=0.02,overlap=0.9,skew=1.2"
run() {  # name hosts rph
  local name=$1$TAG hosts=$2 rph=$3
  $PY -m zen_ds cluster --hosts $hosts --ranks-per-host $rph --rate $RATE --timeout 580 -- \
      $PY -m zen_ds bench calibrate --repeats 5 > bench_out/cal_$name.txt 2>&1
  local alpha=$($PY -c "import json,re,sys;t=open('bench_out/cal_$name.txt').read();j=json.loads(t[t.index('{'):t.rindex('}')+1]);print(j['zen']['network']['alpha'])")
  local bw=$($PY -c "import json;t=open('bench_out/cal_$name.txt').read();j=json.loads(t[t.index('{'):t.rindex('}')+1]);print(j['zen']['network']['bandwidth'])")
  local ibw=$($PY -c "import json;t=open('bench_out/cal_$name.txt').read();j=json.loads(t[t.index('{'):t.rindex('}')+1]);print(j['zen']['network']['intra_bandwidth'])")
  local duplex=$($PY -c "import json;t=open('bench_out/cal_$name.txt').read();j=json.loads(t[t.index('{'):t.rindex('}')+1]);print(j['zen']['network']['duplex'])")
  local a2a=$($PY -c "import json;t=open('bench_out/cal_$name.txt').read();j=json.loads(t[t.index('{'):t.rindex('}')+1]);print(j['zen']['network']['all_to_all_duplex'])")
  echo "$name alpha=$alpha bw=$bw intra=$ibw duplex=$duplex a2a=$a2a" >> bench_out/design_log.txt
  $PY -m zen_ds cluster --hosts $hosts --ranks-per-host $rph --rate $RATE --timeout 2400 -- \
      $PY -m zen_ds bench sync $WL --schemes all auto --interleave --iters $ITERS "${EXTRA[@]}" --no-progress --alpha $alpha --bandwidth $bw --intra-bandwidth $ibw --duplex $duplex --all-to-all-duplex $a2a \
      --json bench_out/design_$name.json > bench_out/design_$name.txt 2>&1
  echo "$name done rc=$? $(date)" >> bench_out/design_log.txt
}
date >> bench_out/design_log.txt
for topo in "${@:-h4 h4x2 h8}"; do
  for t in $topo; do
    hosts=${t#h}; rph=1
    case $hosts in *x*) rph=${hosts#*x}; hosts=${hosts%x*};; esac
    run $t $hosts $rph
  done
done
