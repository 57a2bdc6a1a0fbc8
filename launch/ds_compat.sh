#!/usr/bin/env bash
# The maintainer's DeepSpeed compatibility run (see launch/ds_compat.py): DeepSpeed's own engine
# unit tests on CPU with 2 gloo ranks, stock and with zen injected into every deepspeed.initialize.
# Needs a checkout of DeepSpeed's repository (its tests/), outside this repository; fetches nothing.
#
#   launch/ds_compat.sh /tmp/ds_checkout                       # default list, all three modes
#   launch/ds_compat.sh /tmp/ds_checkout --modes stock,zen -k no_sync
#   DS_COMMIT=<sha> launch/ds_compat.sh /tmp/ds_checkout       # checkout without .git (git archive)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 DEEPSPEED_CHECKOUT [ds_compat.py options...]   (python launch/ds_compat.py --help)" >&2
  exit 2
fi
CHECKOUT="$1"; shift
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
exec "${ZEN_PY}" "${REPO}/launch/ds_compat.py" --checkout "${CHECKOUT}" \
  ${DS_COMMIT:+--commit "${DS_COMMIT}"} --out "${OUT:-${REPO}/bench_out/ds_compat}" "$@"
