#!/usr/bin/env bash
# The newcomer's path, for real (tests/newcomer/): a fresh copy of the repository and a plain shell
# run the README's main job and the launchers, which must set up their own environment. Minutes of
# set-up and cold builds, so it runs after the suite in .ci/run (every CI run), not inside
# `bash tests/run.sh`. Needs the test environment (pytest) that tests/run.sh creates.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${ZEN_DS_VENV:-$repo/.venv}"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import pytest" 2>/dev/null; then
    echo "error: $venv has no pytest: run 'bash tests/run.sh -m unit' first (it creates the test environment)" >&2
    exit 1
fi
unset PYTHONDONTWRITEBYTECODE
echo "== newcomer tests (a fresh copy of the repository, a plain shell, no environment yet)"
start=$SECONDS
set +e
"$venv/bin/python" -m pytest tests/newcomer --durations=0 "$@"
status=$?
set -e
printf 'newcomer tests: %dm%02ds (pytest exit %d)\n' $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)) "$status"
if [ "$status" -eq 5 ]; then
    echo "pytest collected no newcomer tests: treat as a failure" >&2
    exit 1
fi
exit "$status"
