#!/usr/bin/env bash
# Run the whole test suite: setup if needed, then the serial tests and the MPI tests under
# mpirun -n 1, 2 and 4, and the grid-equivalence and checkpoint-reshard tests under mpirun -n 8.
# Extra arguments go to every pytest call (e.g. -k grid, -x).
#   launch/test.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/setup.sh"
source "$here/env.sh"
cd "$repo"

# Every pytest call has a per-test timeout (pytest-timeout) and an outer timeout, so a rank
# stuck in a collective fails the run instead of hanging it.
pytest_args=(-q --color=no -p no:cacheprovider --timeout=300 "$@")
failed=()

run_group() {  # name, command...
  local name="$1"; shift
  echo "=== $name: $*"
  local rc=0
  timeout --kill-after=30 1200 "$@" || rc=$?
  case $rc in
    0) ;;
    5) echo "=== $name: pytest collected no tests: the suite is broken (a test group must never be empty)"; failed+=("$name (no tests)") ;;
    124|137) echo "=== $name: timed out"; failed+=("$name (timeout)") ;;
    *) failed+=("$name (exit $rc)") ;;
  esac
}

# Serial: everything not marked mpi (the mpi-marked tests are skipped without --with-mpi).
run_group serial python -m pytest "${pytest_args[@]}" -m "not mpi" tests/
for n in 1 2 4; do
  run_group "mpi-$n" mpirun -n "$n" python -m pytest "${pytest_args[@]}" --with-mpi -m mpi tests/
done
# 8 ranks: the any-grid = one-rank matrix and checkpoint resharding (their tests need 8 ranks;
# the rest already ran above).
run_group mpi-8 mpirun -n 8 python -m pytest "${pytest_args[@]}" --with-mpi -m mpi \
  tests/test_parallel_equivalence.py tests/test_checkpoint_reshard.py

if [ ${#failed[@]} -gt 0 ]; then
  echo "=== FAILED: ${failed[*]}"
  exit 1
fi
echo "=== all test groups passed (serial, mpi-1, mpi-2, mpi-4, mpi-8)"
