#!/usr/bin/env bash
# Multi-node with the DeepSpeed launcher: a hostfile ("host slots=N" lines, see
# launch/hostfile.example) lists the nodes in node-rank order. Every host needs the same repo path
# and Python environment. Two ways to start the ranks:
#
#  * from one node, over passwordless ssh: DeepSpeed's runner starts every host's ranks (pdsh, or
#    LAUNCHER=openmpi / mvapich / slurm / ...); MASTER_ADDR defaults to the first host's address.
#      HOSTFILE=launch/hostfile launch/multi_node.sh --tp 2 --pp 2 --vocab 262144
#  * without ssh: run this script on every node with NODE_RANK (its line in the hostfile, from 0)
#    and MASTER_ADDR (node 0's address) set; each starts its own ranks (the runner's --no_ssh).
#      NODE_RANK=1 MASTER_ADDR=10.0.0.1 HOSTFILE=launch/hostfile launch/multi_node.sh --vocab 262144
#    On the emulated cluster, `python -m zen_ds cluster --per-host` runs it once per host with
#    both set and its own hostfile (ZEN_CLUSTER_HOSTFILE):
#      sudo launch/cluster.sh --hosts 4 --per-host -- launch/multi_node.sh --vocab 4096 --steps 3
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-${ZEN_CLUSTER_HOSTFILE:-${REPO}/launch/hostfile}}"
if [[ ! -f "${HOSTFILE}" ]]; then
  echo "error: hostfile ${HOSTFILE} not found; copy launch/hostfile.example to launch/hostfile, list" \
       "your hosts (\"name slots=N\") and re-run (or set HOSTFILE=path)" >&2
  exit 2
fi
SCRIPT="${SCRIPT:-${REPO}/examples/train_lm.py}"
# Every node must use the same port: no free-port search here.
ARGS=(--hostfile "${HOSTFILE}" --master_port "${MASTER_PORT:-29500}")
[[ -n "${NUM_NODES:-}" ]] && ARGS+=(--num_nodes "${NUM_NODES}")
if [[ -n "${NODE_RANK:-}" ]]; then
  if [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "error: NODE_RANK=${NODE_RANK} launches this node's ranks only (no ssh); set MASTER_ADDR to" \
         "node 0's address on every node (the runner would otherwise ask node 0 over ssh)" >&2
    exit 2
  fi
  echo "multi_node.sh: node ${NODE_RANK} of $(grep -cE '^[^#[:space:]]+[[:space:]]+slots=' "${HOSTFILE}")" \
       "in ${HOSTFILE}, master ${MASTER_ADDR}; starting this node's ranks (DeepSpeed --no_ssh)" >&2
  ARGS+=(--no_ssh --node_rank "${NODE_RANK}" --master_addr "${MASTER_ADDR}")
else
  ARGS+=(--launcher "${LAUNCHER:-pdsh}")
  [[ -n "${MASTER_ADDR:-}" ]] && ARGS+=(--master_addr "${MASTER_ADDR}")
  # Over ssh the launcher forwards PYTHON* variables to every host; list others (e.g.
  # NCCL_SOCKET_IFNAME, OMP_NUM_THREADS, ZEN_DS_RANKS_PER_NODE) one "NAME=value" per line in
  # ~/.deepspeed_env or ./.deepspeed_env.
fi
[[ "${SCRIPT}" == *train_lm.py ]] && export ZEN_NEEDS="${ZEN_NEEDS:-megatron.core}"
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
exec "${ZEN_PY}" -m deepspeed.launcher.runner "${ARGS[@]}" "${SCRIPT}" "$@"
