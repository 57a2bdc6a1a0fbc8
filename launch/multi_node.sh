#!/usr/bin/env bash
# Multi-node: the DeepSpeed launcher reads a hostfile ("host slots=N" lines, see
# launch/hostfile.example) and starts the ranks over passwordless ssh (pdsh if installed).
# Every host needs the same repo path and Python environment; MASTER_ADDR is the first host.
#
#   HOSTFILE=launch/hostfile launch/multi_node.sh --tp 2 --pp 2 --vocab 262144
#   HOSTFILE=... LAUNCHER=openmpi launch/multi_node.sh ...   # other deepspeed --launcher values
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-${REPO}/launch/hostfile}"
if [[ ! -f "${HOSTFILE}" ]]; then
  echo "error: hostfile ${HOSTFILE} not found; copy launch/hostfile.example to launch/hostfile, list" \
       "your hosts (\"name slots=N\") and re-run (or set HOSTFILE=path)" >&2
  exit 2
fi
SCRIPT="${SCRIPT:-${REPO}/examples/train_lm.py}"
ARGS=(--hostfile "${HOSTFILE}" --master_port "${MASTER_PORT:-29500}" --launcher "${LAUNCHER:-pdsh}")
[[ -n "${MASTER_ADDR:-}" ]] && ARGS+=(--master_addr "${MASTER_ADDR}")
[[ -n "${NUM_NODES:-}" ]] && ARGS+=(--num_nodes "${NUM_NODES}")
# The launcher forwards PYTHON* variables to every host; list others (e.g. NCCL_SOCKET_IFNAME,
# OMP_NUM_THREADS) one "NAME=value" per line in ~/.deepspeed_env or ./.deepspeed_env.
[[ "${SCRIPT}" == *train_lm.py ]] && export ZEN_NEEDS="${ZEN_NEEDS:-megatron.core}"
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
exec "${ZEN_PY}" -m deepspeed.launcher.runner "${ARGS[@]}" "${SCRIPT}" "$@"
