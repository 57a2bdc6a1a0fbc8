#!/usr/bin/env bash
# CPU seconds and wall seconds of each multirank test file, each run alone in its own pytest,
# counted for the whole process tree (ranks, launchers, compilers, fork servers included) by a
# cgroup's cpu accounting: what a file costs the suite, whatever else the machine is doing.
#
#   sudo bash tests/cpu_profile.sh [TEST_FILE...]   # after `bash tests/run.sh` set up .venv
#
# Without arguments: every multirank file and the README commands. One line per file, also
# appended to cpu_profile.txt.
#
# Needs root and the cgroup v1 cpuacct controller (/sys/fs/cgroup/cpuacct) or cgroup v2. Each
# line also pays one pytest start and one fork-server preload (~9 s of CPU on a 2-core VM), which
# the whole suite pays once.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out=cpu_profile.txt
files=("$@")
if [[ ${#files[@]} -eq 0 ]]; then
    mapfile -t files < <(find tests/multirank -name 'test_*.py' | sort)
    files+=(tests/test_readme_commands.py)
fi
venv="${ZEN_DS_VENV:-$repo/.venv}"
if [[ -d /sys/fs/cgroup/cpuacct ]]; then
    cg=/sys/fs/cgroup/cpuacct/zen_ds_cpu_profile_$$
    usage() { echo $(( $(cat "$cg/cpuacct.usage") / 1000000000 )); }
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    cg=/sys/fs/cgroup/zen_ds_cpu_profile_$$
    usage() { echo $(( $(awk '/^usage_usec/{print $2}' "$cg/cpu.stat") / 1000000 )); }
else
    echo "no cgroup cpu accounting here (needs /sys/fs/cgroup/cpuacct or cgroup v2)" >&2
    exit 1
fi
mkdir "$cg" || { echo "cannot create $cg: run as root" >&2; exit 1; }
trap 'echo $$ > "$(dirname "$cg")/cgroup.procs" 2>/dev/null || true; rmdir "$cg" 2>/dev/null || true' EXIT
echo $$ > "$cg/cgroup.procs"
# shellcheck disable=SC1091
. "$venv/bin/activate"
unset PYTHONDONTWRITEBYTECODE
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$repo/.torch_extensions}" OMP_NUM_THREADS=1
for file in "${files[@]}"; do
    cpu0=$(usage); t0=$SECONDS
    set +e
    python -m pytest "$file" -q -p no:cacheprovider --timeout 900 > /dev/null 2>&1
    status=$?
    set -e
    printf '%-70s cpu %5d s  wall %5d s  exit %d  load %s\n' "$file" $(( $(usage) - cpu0 )) \
        $(( SECONDS - t0 )) "$status" "$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out"
done
