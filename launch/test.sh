#!/usr/bin/env bash
# Run the whole test suite: setup if needed, then the serial tests and the MPI tests under
# mpirun -n 1, 2 and 4, the grid-equivalence and checkpoint-reshard tests under mpirun -n 8, the
# Slurm tests (srun, sbatch) against a local one-node Slurm (launch/slurm_local.sh; beside the
# one-rank group; skipped where none can be had: not root, no apt-get) and the multinode tests
# across 2 simulated nodes (launch/cluster_local.sh: mpirun and sbatch -N 2, a killed node, a cut
# link; skipped, with the reason, where namespaces cannot be made). Extra arguments go to every
# pytest call (e.g. -k grid, -x). GRIDLM_TEST_WORKERS: the serial group's worker processes
# (default 4; 0 runs it in one process).
# Two tiers (docs/TESTING.md): by default the quick one (CI's), which leaves out the tests marked
# `full` — two thirds of the 8-rank grid matrix (the third that runs exercises every axis size and
# setting of it), the benchmark scripts' smoke runs, and the second and later cases of a few
# end-to-end parametrisations; --full (first argument) runs every test. Run it after a change to
# the parallel, model, optimizer or checkpoint code, and before a release.
#   launch/test.sh [--full] [pytest arguments]
set -euo pipefail
tier=quick
if [ "${1:-}" = "--full" ]; then tier=full; shift; fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/setup.sh"
source "$here/env.sh"
cd "$repo"
# The suite starts hundreds of Python processes (pytest under mpirun, python -m app): let them keep
# the compiled bytecode of the repository and of pytest's rewritten test modules (__pycache__,
# git-ignored) even where the environment says not to. A collection of tests/ takes 2.2 s of CPU
# instead of 4.9 s, and every rank of every MPI group collects.
unset PYTHONDONTWRITEBYTECODE

# Every pytest call has a per-test timeout (pytest-timeout) and an outer timeout, so a rank
# stuck in a collective fails the run instead of hanging it.
pytest_args=(-q --color=no -p no:cacheprovider --timeout=300 "$@")
if [ "$tier" = quick ]; then pytest_args+=(--quick); fi
# Under mpirun a timeout must end the rank (thread method: dump every thread's stack, naming the
# test, then exit), so mpirun ends the job; the signal method would leave the other ranks waiting
# in a collective for the one that moved on to the next test.
# 600 s a test: ten times the slowest MPI test on a quiet machine (an 8-rank equivalence case once
# passed 300 s with the load average at 266).
mpi_args=(--timeout=600 --timeout-method=thread --with-mpi -m mpi)
# As root, setup installed everything: a test skipped for want of something is a failure, and
# each group must run at least as many tests as it ran when its floor was last set (--min-tests;
# raise a floor when a group gains tests, so that losing them later fails the run).
root=0 selected=$(( $# > 0 ))
if [ "$(id -u)" = 0 ]; then pytest_args+=(--strict-skips); root=1; fi
floor() {  # group name -> --min-tests N (as root only), for this tier
  local n
  case "$tier-$1" in
    full-serial) n=1567 ;; quick-serial) n=1525 ;; full-mpi-8) n=147 ;; quick-mpi-8) n=64 ;;  # tests marked full
    full-multinode) n=10 ;; quick-multinode) n=8 ;;
    *-mpi-1) n=105 ;; *-mpi-2) n=174 ;; *-mpi-4) n=204 ;; *-slurm) n=4 ;;  # the same in both
    *) n=0 ;;
  esac
  # Not with a selection of the caller's (-k, -x, a file): it runs fewer on purpose.
  if [ "$root" = 1 ] && [ "$selected" = 0 ]; then echo "--min-tests=$n"; else echo "--min-tests=0"; fi
}
failed=()

# Outer limits per group: about 5x each group's time on a quiet 2-core machine (shared
# machines slow down that much), and the whole run stays under CI's 90 minutes.
run_group() {  # name, limit in seconds, command...
  local name="$1" limit="$2"; shift 2
  echo "=== $name: $*"
  local rc=0
  timeout --kill-after=30 "$limit" "$@" || rc=$?
  case $rc in
    0) ;;
    5) echo "=== $name: pytest collected no tests: the suite is broken (a test group must never be empty)"; failed+=("$name (no tests)") ;;
    124|137) echo "=== $name: timed out"; failed+=("$name (timeout)") ;;
    *) failed+=("$name (exit $rc)") ;;
  esac
}

# Groups that need a service this run starts: a one-node Slurm (srun, sbatch --wait of real jobs)
# and 2 simulated nodes (namespaces on a bridge, a Slurm of one slurmd per node). Each is stopped
# on every way out (trap) unless it was up before this run (then it is someone else's, e.g. a
# developer's), and its group is skipped, with the script's reason, where it exits 3.
started=()  # the service scripts this run started and has not stopped
stop_started() {
  local script
  for script in "${started[@]}"; do
    "$script" stop || echo "=== stopping the service of $script failed (see $script stop)"
  done
  started=()
}
done_groups=()

# service_group NAME SCRIPT "START ARGS" CANNOT_PREFIX PYTEST_ARGS...: start the service (its
# stdout is export lines, its messages are kept for a skip's reason), run the group, stop it.
service_group() {
  local name="$1" script="$2" start_args="$3" cannot="$4" log rc=0 exports was_up=0 reason
  shift 4
  log="$(mktemp)"
  "$script" status >/dev/null 2>&1 && was_up=1
  # shellcheck disable=SC2086 # the start arguments are words
  exports="$("$script" start $start_args 2>"$log")" || rc=$?
  cat "$log"
  case $rc in
    0)
      [ "$was_up" = 1 ] || started+=("$script")
      eval "$exports"
      run_group "$name" 600 python -m pytest "${pytest_args[@]}" "$(floor "$name")" "$@"
      stop_started
      done_groups+=("$name")
      ;;
    3)
      reason="$(sed -n "s/.*$cannot: //p" "$log" | head -n 1)"
      echo "=== $name: skipped: ${reason:-$script start exited 3}"
      done_groups+=("$name skipped")
      ;;
    *)
      echo "=== $name: $script start failed (exit $rc)"
      failed+=("$name (start, exit $rc)")
      ;;
  esac
  rm -f "$log"
}

# The Slurm group waits on the scheduler and its jobs for most of its half minute, so it runs beside
# the one-rank group (one core busy) in a background subshell, whose output, failures and groups
# are taken back (printed after that group's) when both are done. Never beside the groups whose
# ranks run in lockstep collectives: they lose far more to shared cores. (The multinode group
# beside the serial one: 8.0 and 10.0 minutes together in two runs against 8.2-9.1 apart, a wash,
# and its tests time a killed node and a cut link: it runs alone, last.)
declare -A beside_pid beside_dir
stop_beside() {
  local name
  for name in "${!beside_pid[@]}"; do
    kill "${beside_pid[$name]}" 2>/dev/null || true
    wait "${beside_pid[$name]}" 2>/dev/null || true
  done
  stop_started
}
trap stop_beside EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
beside() {  # NAME COMMAND...: run COMMAND (service_group ...) in the background
  local name="$1" dir
  shift
  dir="$(mktemp -d)"
  (
    failed=() done_groups=() started=()
    trap stop_started EXIT
    trap 'exit 143' TERM
    "$@"
    printf '%s\n' "${failed[@]}" >"$dir/failed"
    printf '%s\n' "${done_groups[@]}" >"$dir/done"
  ) >"$dir/log" 2>&1 &
  beside_pid[$name]=$! beside_dir[$name]="$dir"
}
take_back() {  # NAME: wait for the background group, print its output, take its results
  local name="$1" rc=0 line dir="${beside_dir[$1]}"
  wait "${beside_pid[$name]}" || rc=$?
  unset "beside_pid[$name]" "beside_dir[$name]"
  cat "$dir/log"
  [ -f "$dir/done" ] || failed+=("$name (exit $rc)")
  while read -r line; do [ -z "$line" ] || failed+=("$line"); done < <(cat "$dir/failed" 2>/dev/null)
  while read -r line; do [ -z "$line" ] || done_groups+=("$line"); done < <(cat "$dir/done" 2>/dev/null)
  rm -rf "$dir"
}

# Serial: everything not marked mpi or slurm (those groups follow), in parallel worker processes
# (pytest-xdist; a file's tests stay on one worker). Most of these tests wait on the mpirun jobs
# they start, so more workers than cores keep 2 cores busy: 6m14s -> 3m35s with 3 on this kind of
# machine; the quick tier's took 6m05s with 3, 5m31s with 4 and 5m52s with 6 (2026-11-29, one run
# each).
workers="${GRIDLM_TEST_WORKERS:-4}"
run_group serial 1500 python -m pytest "${pytest_args[@]}" "$(floor serial)" -n "$workers" --dist loadfile \
  -m "not mpi and not slurm and not multinode" tests/

beside slurm service_group slurm "$here/slurm_local.sh" "" "cannot provide Slurm here" \
  --with-slurm -m slurm tests/test_slurm.py tests/test_study.py
for n in 1 2 4; do
  run_group "mpi-$n" 600 mpirun -n "$n" python -m pytest "${pytest_args[@]}" "$(floor "mpi-$n")" "${mpi_args[@]}" tests/
  if [ "$n" = 1 ]; then take_back slurm; fi
done
# 8 ranks: the tests that need 8 (the any-grid = one-rank matrix, checkpoint resharding); the
# rest already ran above.
run_group mpi-8 3000 mpirun -n 8 python -m pytest "${pytest_args[@]}" "$(floor mpi-8)" "${mpi_args[@]}" --mpi-min-size 8 tests/

service_group multinode "$here/cluster_local.sh" "2" "cannot provide simulated nodes here" \
  --with-cluster -m multinode tests/test_multinode.py

if [ ${#failed[@]} -gt 0 ]; then
  echo "=== FAILED: ${failed[*]}"
  exit 1
fi
echo "=== all test groups passed, $tier tier (serial, mpi-1, mpi-2, mpi-4, mpi-8$(printf ', %s' "${done_groups[@]}"))"
