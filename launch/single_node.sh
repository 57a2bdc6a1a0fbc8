#!/usr/bin/env bash
# Single node: N ranks on this machine with the DeepSpeed launcher (GPUs, or N CPU ranks with the
# CPU accelerator). DP = N / (tp * pp).
#
#   launch/single_node.sh 4 --tp 2                 # 4 ranks, TP=2 x DP=2, zen on
#   launch/single_node.sh 4 --pp 2 --tied --no-zen # PP=2 x DP=2, DeepSpeed's own reduction
#   SCRIPT=my_train.py launch/single_node.sh 8 ... # any other training script
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NUM_RANKS [train_lm.py options...]   (e.g. $0 4 --tp 2)" >&2
  exit 2
fi
NUM="$1"; shift
SCRIPT="${SCRIPT:-${REPO}/examples/train_lm.py}"
# Finds (or creates) the Python environment; train_lm.py also needs megatron-core.
[[ "${SCRIPT}" == *train_lm.py ]] && export ZEN_NEEDS="${ZEN_NEEDS:-megatron.core}"
[[ "${SCRIPT}" == *hf_trainer.py ]] && export ZEN_NEEDS="${ZEN_NEEDS:-transformers accelerate}"
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
# A free port unless MASTER_PORT says otherwise: two jobs on one port (or the shared-memory
# buffers DeepSpeed's CPU accelerator names after it, left by a killed job) would meet.
PORT="${MASTER_PORT:-$("${ZEN_PY}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
exec "${ZEN_PY}" -m deepspeed.launcher.runner --num_gpus "${NUM}" --master_port "${PORT}" "${SCRIPT}" "$@"
