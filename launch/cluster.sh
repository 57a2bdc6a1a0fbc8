#!/usr/bin/env bash
# Emulated cluster: N network-namespace "hosts" with tc-shaped links, one rank per host.
# Thin wrapper over `python -m zen_ds cluster` (see its --help); needs root for namespaces and tc.
#
#   launch/cluster.sh --hosts 4 --rate 1gbit --selftest
#   launch/cluster.sh --hosts 4 --rate 1gbit -- python -m zen_ds bench sync --workload lm
#   launch/cluster.sh --cleanup        # remove namespaces left by a crashed run
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "$(id -u)" != "0" ]]; then
  echo "error: the emulated cluster needs root (network namespaces, tc); re-run with sudo -E $0 $*" >&2
  exit 3
fi
# Finds the Python environment and makes zen_ds importable on every host even when it is not
# pip-installed (the namespaces inherit this environment).
# shellcheck source=launch/env.sh
source "${REPO}/launch/env.sh"
[[ "${ZEN_ENV_OK}" == 1 ]] || exit 1
exec "${ZEN_PY}" -m zen_ds cluster "$@"
