#!/usr/bin/env bash
# A real single-node Slurm on this machine, for the tests (launch/test.sh, tests/test_slurm.py):
# Debian's slurm-wlm (slurmctld + slurmd) with munge, configured and logging in one state dir.
#   launch/slurm_local.sh start    install if missing (apt, root), start, print `export SLURM_CONF=...`
#   launch/slurm_local.sh status   sinfo; exit 0 if up, 1 if not
#   launch/slurm_local.sh stop     cancel the jobs, stop slurmd and slurmctld (exit 0 if nothing ran)
#   launch/slurm_local.sh install  install Slurm and munge if missing (launch/cluster_local.sh uses it)
#   launch/slurm_local.sh munge    start munged if it does not answer
#   eval "$(launch/slurm_local.sh start)"
# Messages go to stderr; stdout carries only the export line, so callers can eval it.
# Exit status 3: Slurm cannot be provided here (missing and no root + apt-get): callers skip.
# munge is left running by `stop`: it holds no job state, and other users of the host may rely on it.
#
# Environment knobs:
#   GRIDLM_SLURM_DIR   slurm.conf, state, spool, logs and pid files   (default: /tmp/gridlm-slurm)
set -euo pipefail

dir="${GRIDLM_SLURM_DIR:-/tmp/gridlm-slurm}"
conf="$dir/slurm.conf"
# The daemons live in /usr/sbin, which is not on a normal user's PATH.
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$conf"

say() { echo "[slurm] $*" >&2; }
die() { echo "[slurm] ERROR: $*" >&2; exit "${2:-1}"; }
cannot() { echo "[slurm] cannot provide Slurm here: $*" >&2; exit 3; }

# The pid in a daemon's pid file, if that process is alive and is that daemon (pids get reused).
live_pid() {  # name
  local pid
  pid="$(cat "$dir/$1.pid" 2>/dev/null || true)"
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$1" ] && echo "$pid"
}

# The node's state as sinfo reports it; empty when our slurmctld is not running (sinfo would
# retry for 10 s) or does not answer.
node_state() {
  [ -f "$conf" ] && [ -n "$(live_pid slurmctld)" ] && timeout 10 sinfo -h -o %T 2>/dev/null | head -n 1 || true
}
# Up: both daemons alive (slurmctld would call a dead slurmd's node idle for minutes) and the node usable.
is_up() { [ -n "$(live_pid slurmd)" ] && [[ "$(node_state)" =~ ^(idle|mixed|allocated|completing)$ ]]; }

print_export() { printf 'export SLURM_CONF=%q\n' "$conf"; }  # %q: the caller evals it

logs_tail() {
  local f
  for f in "$dir"/log/*; do
    if [ -f "$f" ]; then
      { echo "--- $f (last 25 lines)"; tail -n 25 "$f"; } >&2
    fi
  done
}

install_slurm() {
  local missing=() cmd
  for cmd in slurmctld slurmd srun sbatch sinfo squeue scancel scontrol munged munge; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    cannot "missing ${missing[*]}, and installing them needs root and apt-get (Debian/Ubuntu)"
  fi
  say "installing slurmctld slurmd slurm-client munge with apt-get (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurmctld slurmd slurm-client munge)
  # The package lists are often fresh enough; update only when the install fails.
  apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null; } ||
    die "apt-get install ${pkgs[*]} failed"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    say "creating $key"
    mkdir -p /etc/munge
    mungekey --create --keyfile="$key" 2>/dev/null || dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
  fi
  # munged refuses keys and dirs that others can read or write.
  chown munge:munge /etc/munge "$key"
  chmod 0700 /etc/munge
  chmod 0400 "$key"
  mkdir -p /run/munge
  chown munge:munge /run/munge
  chmod 0755 /run/munge
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
  munge -n | unmunge >/dev/null || die "munge does not answer after starting munged"
}

write_conf() {
  local host
  host="$(hostname -s)"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat >"$conf" <<EOF
# Written by launch/slurm_local.sh: a one-node Slurm for the tests. Edits are overwritten by 'start'.
ClusterName=gridlm-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# No cgroups in containers: track job processes by parent pid; no binding or confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
# Debian's OpenMPI starts under srun with PMIx only.
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node's CPUs are what this file says (8, so an 8-rank job fits on a 2-core machine).
SlurmdParameters=config_overrides
# A node that was down (daemons stopped) comes back as soon as slurmd registers.
ReturnToService=2
# Signals: --signal=[B:]SIG@SECONDS and scancel --signal need nothing beyond these: slurmctld checks
# time limits every 30 s (so a signal may come up to a minute early), and KillWait is the grace
# between SIGTERM and SIGKILL at the time limit or on scancel.
KillWait=30
OverTimeLimit=0
# sbatch --wait polls at 2, 8, 32 s... while the poll interval is under MinJobAge/2: with the
# default 300 a 10 s job returned after 42 s; with 5 it polls every 2 s. Finished jobs stay in
# squeue / scontrol show job for 5 s to a minute (the purge runs once a minute).
MinJobAge=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
# The one node also stands in for the GPU nodes of inputs/machines/, so that sbatch --test-only
# accepts their job scripts (tests/test_study.py): 8 GPUs (gres.conf), the feature of Perlmutter's
# --constraint=gpu, and the machines' default partitions (local: debug, frontier: batch, alps:
# normal), all on this node.
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 RealMemory=8000 Gres=gpu:8 Feature=gpu State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=batch Nodes=$host MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=normal Nodes=$host MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  # slurmd drops GPUs without a File= (a Count alone registers 0 and the node goes INVAL), and the
  # files must be devices: 8 links to /dev/null. Nothing opens them (TaskPlugin=task/none binds and
  # confines nothing); a job that asks for GPUs just gets CUDA_VISIBLE_DEVICES.
  mkdir -p "$dir/dev"
  local i
  for i in 0 1 2 3 4 5 6 7; do
    ln -sfn /dev/null "$dir/dev/gpu$i"
  done
  cat >"$dir/gres.conf" <<EOF
# Written by launch/slurm_local.sh: the 8 GPUs of slurm.conf's node, stand-ins linked to /dev/null.
Name=gpu File=$dir/dev/gpu[0-7]
EOF
}

start() {
  if is_up; then
    say "already up ($conf): $(node_state)"
    print_export
    return 0
  fi
  install_slurm
  [ "$(id -u)" = 0 ] || cannot "slurmd must run as root to start jobs (this is uid $(id -u))"
  start_munge
  # Keep the state of a previous run (job ids keep counting up) but not a stale config.
  [ -n "$(live_pid slurmctld)" ] || [ -n "$(live_pid slurmd)" ] || write_conf
  local t0=$SECONDS name
  for name in slurmctld slurmd; do
    if [ -z "$(live_pid "$name")" ]; then
      say "starting $name"
      # setsid: the daemons outlive this script and are not killed by a Ctrl-C aimed at the caller.
      setsid "$name" -D -f "$conf" </dev/null >>"$dir/log/$name.out" 2>&1 &
    fi
  done
  local state="" resumed=0
  while [ $((SECONDS - t0)) -lt 30 ]; do
    state="$(node_state)"
    if [[ "$state" =~ ^(idle|mixed|allocated|completing)$ ]]; then
      break
    fi
    # A node drained or down in the saved state (e.g. killed daemons) is brought back once.
    if [[ "$state" =~ ^(down|drain|drained|draining)$ ]] && [ $resumed = 0 ]; then
      scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
      resumed=1
    fi
    sleep 0.5
  done
  if ! is_up; then
    logs_tail
    die "Slurm did not come up within 30 s (node state: '${state:-no answer}'); logs in $dir/log"
  fi
  # OpenMPI programs need the PMIx plugin (slurm-wlm-basic-plugins ships it on Debian 12).
  if ! srun --mpi=list 2>&1 | grep -qw pmix; then
    die "srun has no PMIx plugin (srun --mpi=list: $(srun --mpi=list 2>&1 | tr '\n' ' ')); install slurm-wlm-basic-plugins"
  fi
  say "up in $((SECONDS - t0)) s: node $(hostname -s) $state, partitions debug (default), batch, normal; 8 CPUs, gpu:8 (stand-ins); logs in $dir/log"
  print_export
}

stop() {
  local ctld slurmd_pid name pid waited
  ctld="$(live_pid slurmctld || true)"
  slurmd_pid="$(live_pid slurmd || true)"
  if [ -z "$ctld" ] && [ -z "$slurmd_pid" ]; then
    say "not running"
    return 0
  fi
  if [ -n "$(node_state)" ]; then
    # Jobs first (everyone's), so that their processes end before the daemons that track them.
    local jobs
    jobs="$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086 # one job id per word
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 20); do
        [ -z "$(squeue -h -t running,completing -o %A 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
  fi
  for name in slurmd slurmctld; do
    pid="$(live_pid "$name" || true)"
    [ -n "$pid" ] || continue
    say "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    # Follow the process, not its pid file: the daemons remove the file before they exit.
    waited=0
    while [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$name" ] && [ $waited -lt 30 ]; do
      sleep 0.5
      waited=$((waited + 1))
    done
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$name" ]; then
      say "$name did not stop in 15 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$dir/slurmctld.pid" "$dir/slurmd.pid"
  say "stopped (munge left running)"
}

status() {
  if is_up; then
    sinfo -N -o "%N %P %T %c" >&2
    print_export
    return 0
  fi
  say "not up (state dir $dir; sinfo: '$(node_state)')"
  return 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  # For launch/cluster_local.sh, which runs its own multi-node Slurm with the same packages and munge.
  install) install_slurm ;;
  munge) start_munge ;;
  *)
    echo "usage: launch/slurm_local.sh start|stop|status|install|munge   (GRIDLM_SLURM_DIR, default /tmp/gridlm-slurm)" >&2
    exit 2
    ;;
esac
