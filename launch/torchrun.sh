#!/usr/bin/env bash
# torchrun instead of the DeepSpeed launcher (the script calls deepspeed.init_distributed, which
# picks up torchrun's RANK / WORLD_SIZE / MASTER_ADDR). Single node by default; for several nodes
# run it on each node with NNODES, NODE_RANK (0 .. NNODES-1) and MASTER_ADDR (node 0's address)
# set: torchrun's static rendezvous at MASTER_ADDR:MASTER_PORT (29500), node ranks as given.
#
#   launch/torchrun.sh 4 --tp 2 --pp 2 --tied
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh 8 --tp 2   # 8 ranks per node
#   sudo launch/cluster.sh --hosts 4 --per-host -- launch/torchrun.sh 1 --vocab 4096   # emulated hosts
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 RANKS_PER_NODE [train_lm.py options...]   (e.g. $0 4 --tp 2)" >&2
  exit 2
fi
NPROC="$1"; shift
if [[ "${NNODES:-1}" != 1 && -z "${MASTER_ADDR:-}" ]]; then
  echo "error: NNODES=${NNODES} needs MASTER_ADDR (node 0's address, the same on every node)" >&2
  exit 2
fi
SCRIPT="${SCRIPT:-${REPO}/examples/train_lm.py}"
[[ "${SCRIPT}" == *train_lm.py ]] && export ZEN_NEEDS="${ZEN_NEEDS:-megatron.core}"
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
# One node: a free port unless MASTER_PORT says otherwise (several nodes must agree on one: 29500).
if [[ -z "${MASTER_PORT:-}" && "${NNODES:-1}" == 1 ]]; then
  MASTER_PORT="$("${ZEN_PY}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
exec "${ZEN_PY}" -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "${NPROC}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" "${SCRIPT}" "$@"
