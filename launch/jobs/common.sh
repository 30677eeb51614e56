# Sourced by every gridlm job script (launch/jobs/<machine>.sh, rendered by launch/submit.py).
#
#   source "$repo/launch/jobs/common.sh"   # installs the USR1/TERM traps at once
#   gridlm_start NODES RANKS               # job header; stop if the allocation has another node count
#   gridlm_signal_before_end WALLTIME_S LEAD_S   # PBS only: SIGUSR1 to this script LEAD_S s before the end
#   gridlm_use_venv                        # ${GRIDLM_VENV:-$repo/.venv} on PATH if it exists; $repo on PYTHONPATH
#   gridlm_check_python LAUNCH...          # stop (exit 2) unless `python` imports app, torch, mpi4py, h5py
#   gridlm_launch srun ... python -m app DECK ...   # returns the launcher's exit status
#
# Why: the scheduler signals the batch shell (Slurm `--signal=B:USR1@LEAD`, or the PBS timer
# below) and the shell must pass the signal on to the launcher, which forwards it to the ranks
# (srun, mpirun and mpiexec all do); the app then finishes its step, writes a checkpoint and
# exits 0. Safe under `set -euo pipefail`.

# srun ends the whole step when a task dies or exits non-zero (srun -K, unless the job set it):
# without it, a node's ranks that died leave the others blocked in an MPI collective until the
# watchdog's run.comm_timeout_s (measured on launch/cluster_local.sh's nodes: still waiting after
# 100 s; with it the step ended 10 s after the kill, srun naming "gridlm-node2: tasks 4-7: Killed").
export SLURM_KILL_BAD_EXIT="${SLURM_KILL_BAD_EXIT:-1}"

_gridlm_pid=""        # the launcher, once started
_gridlm_caught=0      # set by the trap: `wait` was interrupted, wait again
_gridlm_timer_pid=""  # gridlm_signal_before_end's timer

_gridlm_log() { printf 'gridlm-job: %s %s\n' "$(date '+%F %T')" "$*"; }

_gridlm_on_signal() {  # SIG: forward to the launcher
  _gridlm_caught=1
  if [ -n "$_gridlm_pid" ]; then
    _gridlm_log "SIG$1 -> launcher (pid $_gridlm_pid)" >&2
    kill -s "$1" "$_gridlm_pid" 2>/dev/null || true
  elif [ "$1" = TERM ]; then
    _gridlm_log "SIGTERM before the launch: nothing to checkpoint, exiting" >&2
    exit 143
  else
    # Forwarding now would kill ranks still importing torch; the time-limit SIGTERM still comes.
    _gridlm_log "SIG$1 before the launch: ignored" >&2
  fi
}
trap '_gridlm_on_signal USR1' USR1
trap '_gridlm_on_signal TERM' TERM

# gridlm_start NODES RANKS: print the job header, check the allocation's node count.
gridlm_start() {
  local want="$1" ranks="$2" have="" where="" job="${SLURM_JOB_ID:-${PBS_JOBID:-none}}" commit=""
  if [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then
    have="$SLURM_JOB_NUM_NODES" where="${SLURM_JOB_NODELIST:-}"
  elif [ -n "${PBS_NODEFILE:-}" ] && [ -r "$PBS_NODEFILE" ]; then
    have="$(sort -u "$PBS_NODEFILE" | wc -l)" where="$(sort -u "$PBS_NODEFILE" | head -n 3 | tr '\n' ' ')..."
  fi
  if [ -n "${repo:-}" ] && command -v git >/dev/null 2>&1; then
    commit="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || true)"
    if [ -n "$commit" ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null || true)" ]; then
      commit="$commit (modified)"
    fi
  fi
  _gridlm_log "job $job on $(hostname) | $want node(s) x $((ranks / want)) = $ranks ranks | nodes: ${where:-unknown}"
  _gridlm_log "gridlm ${repo:-?} @ ${commit:-unknown commit} | working directory $(pwd)"
  if [ -n "$have" ] && [ "$have" != "$want" ]; then
    _gridlm_log "ERROR: this script was written for $want node(s) but the job has $have;" \
      "write it again with launch/submit.py --nodes $have" >&2
    exit 2
  fi
}

# gridlm_use_venv: put the venv of launch/setup.sh (GRIDLM_VENV, default $repo/.venv) on PATH
# when it exists; otherwise the python of the site's modules, conda env or container runs. Either
# way the repository goes first on PYTHONPATH: the job runs in the directory submit.py ran in, and a
# site's python has torch, mpi4py and h5py but not gridlm (every rank failed: "No module named app").
gridlm_use_venv() {
  local venv="${GRIDLM_VENV:-${repo:?}/.venv}"
  if [ -x "$venv/bin/python" ]; then
    export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
  fi
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
}

# gridlm_check_python: stop the job (exit 2) unless the `python` of the launch line imports app
# (gridlm), torch, mpi4py and h5py here, on the batch node: a few seconds, instead of every rank
# failing after the queue wait. mpi4py is imported without MPI (no MPI_Init outside the launcher).
# LAUNCH: the launch line's words; a container the launcher starts (srun --container-image of pyxis,
# --environment of CSCS) has a python this node lacks: no check then. GRIDLM_CHECK_PYTHON=0 skips it
# for any other python that only the launcher provides.
gridlm_check_python() {
  if [ "${GRIDLM_CHECK_PYTHON:-1}" = 0 ]; then
    _gridlm_log "python check skipped (GRIDLM_CHECK_PYTHON=0)"
    return 0
  fi
  local word
  for word in "$@"; do
    case "$word" in
      --container-image*|--container-name*|--environment*)
        _gridlm_log "python check skipped: the launcher's container provides python ($word)"
        return 0 ;;
    esac
  done
  local fix="fix: run launch/setup.sh (it makes the venv ${GRIDLM_VENV:-${repo:-<repo>}/.venv}), or load the modules or"
  fix="$fix activate the env that provides them before the launch in this script (docs/CLUSTERS.md); GRIDLM_CHECK_PYTHON=0 skips this check"
  local where status=0 missing
  if ! where="$(command -v python)"; then
    _gridlm_log "ERROR: no python on PATH: the ranks run \`python -m app\`; $fix" >&2
    _gridlm_stop 2
  fi
  missing="$(python -c '
import importlib
missing = []
for name in ("app", "torch", "mpi4py", "h5py"):
    try:
        importlib.import_module(name)
    except Exception as err:
        missing.append("%s (%s: %s)" % (name, type(err).__name__, (str(err).strip().splitlines() or [""])[-1]))
print("; ".join(missing))
raise SystemExit(1 if missing else 0)
' 2>&1)" || status=$?
  if [ "$status" != 0 ]; then
    missing="${missing##*$'\n'}"  # the last line: the list above (or a crash's last words), not warnings
    _gridlm_log "ERROR: $where (PYTHONPATH=${PYTHONPATH:-}) cannot import: ${missing:-its imports ended with status $status};" \
      "$fix" >&2
    _gridlm_stop 2
  fi
  _gridlm_log "python: $where imports app, torch, mpi4py and h5py"
}

# _gridlm_stop STATUS: exit before the launch, ending gridlm_signal_before_end's timer first.
_gridlm_stop() {
  if [ -n "$_gridlm_timer_pid" ]; then
    kill "$_gridlm_timer_pid" 2>/dev/null || true
  fi
  exit "$1"
}

# gridlm_signal_before_end WALLTIME_S LEAD_S: send SIGUSR1 to this script LEAD_S seconds before
# the walltime ends (schedulers without Slurm's --signal, i.e. PBS; counted from now).
gridlm_signal_before_end() {
  local after=$(($1 - $2)) script_pid=$$
  if [ "$after" -le 0 ]; then
    _gridlm_log "walltime $1 s is not longer than $2 s: no checkpoint signal before the end" >&2
    return 0
  fi
  (
    trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
    sleep "$after" &
    sleeper=$!
    wait "$sleeper" && kill -s USR1 "$script_pid"
  ) &
  _gridlm_timer_pid=$!
  _gridlm_log "SIGUSR1 in $after s ($2 s before the walltime of $1 s)"
}

# gridlm_stripe DIR [OPTIONS...]: give the checkpoint directory the Lustre layout `lfs setstripe
# OPTIONS` (the machine file's checkpoint_setstripe for this run's checkpoint size, filled in by
# launch/submit.py) before the job writes there. Every checkpoint is one new file that all ranks
# write, and a new file takes its directory's layout, so its bytes spread over many storage
# targets instead of the file system's default. GRIDLM_STRIPE replaces the options (e.g.
# GRIDLM_STRIPE="-c 16 -S 16M"; "none": leave the layout alone). A directory that is not on
# Lustre, or a machine without `lfs`, keeps its layout, said in the log.
gridlm_stripe() {
  local dir="$1"
  shift
  local options="${GRIDLM_STRIPE:-$*}"
  mkdir -p "$dir"
  if [ -z "$options" ] || [ "$options" = none ]; then
    _gridlm_log "checkpoint directory $dir: its file system's layout (no striping for this machine and size;" \
      "GRIDLM_STRIPE=\"-c N -S SIZE\" sets one)"
  elif ! command -v lfs >/dev/null 2>&1; then
    _gridlm_log "checkpoint directory $dir: no lfs command (not Lustre): layout unchanged (wanted: $options)"
  else
    # shellcheck disable=SC2086 # the options are words
    if lfs setstripe $options "$dir"; then
      _gridlm_log "checkpoint directory $dir: lfs setstripe $options"
    else
      _gridlm_log "warning: lfs setstripe $options $dir failed (not on Lustre?): layout unchanged" >&2
    fi
  fi
}

# gridlm_launch CMD...: run the launcher, forward USR1/TERM to it, return ITS exit status.
gridlm_launch() {
  _gridlm_log "launch: $*"
  "$@" &
  _gridlm_pid=$!
  local rc=0 status
  _gridlm_caught=0
  wait "$_gridlm_pid" || rc=$?
  # A trapped signal ends `wait` early with 128+n: wait again until the launcher itself has
  # exited. (Waiting for a launcher already reported gives its status again, or 127 in older
  # bash versions: then rc already holds it.)
  while [ "$_gridlm_caught" = 1 ]; do
    _gridlm_caught=0
    status=0
    wait "$_gridlm_pid" || status=$?
    [ "$status" = 127 ] && break
    rc=$status
  done
  if [ -n "$_gridlm_timer_pid" ]; then
    kill "$_gridlm_timer_pid" 2>/dev/null || true
  fi
  _gridlm_pid=""
  _gridlm_log "launcher exited with status $rc"
  return "$rc"
}
