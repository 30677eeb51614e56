#!/usr/bin/env bash
# Simulated nodes on this machine: each node is a network namespace and a UTS namespace (its own
# hostname, gridlm-node1, ...) with one veth interface on a private bridge, so that MPI, gloo and
# Slurm see several hosts talking over a network. Nothing is routed off the machine: the nodes have
# no default route, only the bridge's subnet.
#   launch/cluster_local.sh start N [--no-slurm]   N nodes (+ a Slurm with one slurmd per node); prints exports
#   launch/cluster_local.sh status                 nodes, addresses, processes, Slurm; exit 0 if up, 1 if not
#   launch/cluster_local.sh stop                   kill what runs on the nodes, remove namespaces, bridge, hosts
#   launch/cluster_local.sh exec NODE CMD...       run CMD on a node (its network, its hostname)
#   launch/cluster_local.sh shape RATE [DELAY]     limit every node's link (tbf; DELAY needs netem), e.g. 10gbit 20us
#   launch/cluster_local.sh unshape                remove the limits
#   launch/cluster_local.sh link NODE down|up      take a node's link down (a cut cable) or bring it back
#   eval "$(launch/cluster_local.sh start 2)"
#   mpirun -n 8 --host gridlm-node1:4,gridlm-node2:4 python -m app inputs/gpt_tiny.yaml
# Messages go to stderr; stdout carries only the export lines, so that callers can eval them.
# Exit status 3: simulated nodes cannot be made here (not root, no ip/nsenter, namespaces refused).
#
# Environment knobs:
#   GRIDLM_CLUSTER_DIR   state, UTS namespace files, Slurm config and logs  (default: /tmp/gridlm-cluster)
#   GRIDLM_CLUSTER_NET   the bridge's /24, first three octets                (default: 10.231.0)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${GRIDLM_CLUSTER_DIR:-/tmp/gridlm-cluster}"
net="${GRIDLM_CLUSTER_NET:-10.231.0}"
bridge=gridlm-br0
head_addr="$net.1"
slurm_dir="$dir/slurm"
slurm_conf="$slurm_dir/slurm.conf"
# The cluster's slurmctld listens in this (the host's) namespace, next to a one-node Slurm of
# launch/slurm_local.sh that may be running on the default port 6817.
ctld_port=6827
hosts_begin="# >>> gridlm launch/cluster_local.sh (removed by stop)"
hosts_end="# <<< gridlm launch/cluster_local.sh"
export PATH="$PATH:/usr/sbin:/sbin"

say() { echo "[cluster] $*" >&2; }
die() { echo "[cluster] ERROR: $1" >&2; exit "${2:-1}"; }
cannot() { echo "[cluster] cannot provide simulated nodes here: $*" >&2; exit 3; }

node_name() { echo "gridlm-node$1"; }
node_addr() { echo "$net.$((10 + $1))"; }
host_link() { echo "gridlm-n$1"; }  # the host's end of node i's veth (the node's end is eth0)
uts_file() { echo "$dir/uts/$(node_name "$1")"; }
nodes() { cat "$dir/nodes" 2>/dev/null || echo 0; }

# A node's index from its name (gridlm-node2 or 2); dies on anything else.
node_index() {
  local i="${1#gridlm-node}"
  [[ "$i" =~ ^[0-9]+$ ]] && [ "$i" -ge 1 ] && [ "$i" -le "$(nodes)" ] ||
    die "no node '$1' (the cluster has $(nodes) node(s): gridlm-node1..gridlm-node$(nodes))"
  echo "$i"
}

# Run a command inside node i's namespaces: its network (netns) and its hostname (UTS).
in_node() {  # index cmd...
  local i="$1"; shift
  nsenter --net="/run/netns/$(node_name "$i")" --uts="$(uts_file "$i")" -- "$@"
}

exports() {
  # %q: the caller evals these lines, and a path may hold spaces
  printf 'export GRIDLM_CLUSTER_DIR=%q\n' "$dir"
  # mpirun starts its daemons on the nodes with this agent instead of ssh (it enters the node's
  # namespaces), and keeps its own traffic and the ranks' on the bridge.
  printf 'export OMPI_MCA_plm_rsh_agent=%q\n' "$here/cluster_rsh.sh"
  echo "export OMPI_MCA_oob_tcp_if_include=$net.0/24"
  echo "export OMPI_MCA_btl_tcp_if_include=$net.0/24"
  if [ -f "$slurm_conf" ] && [ -n "$(live_pid slurmctld)" ]; then
    printf 'export SLURM_CONF=%q\n' "$slurm_conf"
  fi
}

check_tools() {
  [ "$(id -u)" = 0 ] || cannot "network and UTS namespaces need root (this is uid $(id -u))"
  local cmd
  for cmd in ip nsenter unshare tc mount umount; do
    command -v "$cmd" >/dev/null 2>&1 || cannot "no '$cmd' on PATH (Debian: apt-get install iproute2 util-linux)"
  done
}

write_hosts() {
  local n="$1" i block tmp
  block="$hosts_begin"$'\n'"$head_addr gridlm-head"
  for i in $(seq "$n"); do
    block+=$'\n'"$(node_addr "$i") $(node_name "$i")"
  done
  # The same names for the IPv4-mapped IPv6 form, in which dual-stack servers (torch's TCPStore) see
  # their peers: without them the reverse lookup goes to a DNS server the nodes cannot reach, and
  # every rank logs "[c10d] The hostname of the client socket cannot be retrieved".
  block+=$'\n'"::ffff:$head_addr gridlm-head"
  for i in $(seq "$n"); do
    block+=$'\n'"::ffff:$(node_addr "$i") $(node_name "$i")"
  done
  block+=$'\n'"$hosts_end"
  tmp="$(mktemp)"
  strip_hosts >"$tmp"
  printf '%s\n' "$block" >>"$tmp"
  # In place (not mv): /etc/hosts is often a bind mount in containers.
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

# /etc/hosts without our block.
strip_hosts() { awk -v b="$hosts_begin" -v e="$hosts_end" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts; }

make_node() {  # index
  local i="$1" name link addr
  name="$(node_name "$i")" link="$(host_link "$i")" addr="$(node_addr "$i")"
  ip netns add "$name" || cannot "ip netns add $name failed (no CAP_SYS_ADMIN / network namespaces here?)"
  ip link add "$link" type veth peer name "eth0" netns "$name"
  ip link set "$link" master "$bridge" up
  ip -n "$name" link set lo up
  ip -n "$name" addr add "$addr/24" dev eth0
  ip -n "$name" link set eth0 up
  # A UTS namespace kept alive by a bind mount on a file, so that nsenter can join it later.
  touch "$(uts_file "$i")"
  unshare --uts="$(uts_file "$i")" hostname "$name" ||
    cannot "unshare --uts failed (no UTS namespaces here?)"
}

start() {
  local n="${1:-}" slurm=1
  [ "${2:-}" = "--no-slurm" ] && slurm=0
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 64 ] || die "usage: start N [--no-slurm] (1 <= N <= 64)" 2
  check_tools
  if [ "$(nodes)" != 0 ]; then
    if [ "$(nodes)" = "$n" ] && ip netns list | grep -qw "$(node_name "$n")"; then
      say "already up: $n node(s)"
      if [ $slurm = 1 ]; then start_slurm "$n"; fi
      exports
      return 0
    fi
    die "a cluster of $(nodes) node(s) is up; launch/cluster_local.sh stop first"
  fi
  if ip netns list 2>/dev/null | grep -qE '^gridlm-node[0-9]+( |$)'; then
    die "simulated nodes are left without state in $dir ($(ip netns list | grep -oE '^gridlm-node[0-9]+' | tr '\n' ' ')); launch/cluster_local.sh stop removes them"
  fi
  if ip -o addr show | grep -q " $net\."; then
    if ip link show "$bridge" >/dev/null 2>&1; then
      die "a cluster's bridge $bridge is up without state in $dir; launch/cluster_local.sh stop removes it"
    fi
    die "the subnet $net.0/24 is already in use on this machine; set GRIDLM_CLUSTER_NET (e.g. 10.232.0)"
  fi
  mkdir -p "$dir/uts" "$dir/log"
  echo "$n" >"$dir/nodes"
  # A start that fails half-way takes down what it made (namespaces, bridge, hosts lines).
  trap 'rc=$?; [ $rc = 0 ] || { say "start failed: removing what it made"; stop >/dev/null 2>&1; }; exit $rc' EXIT
  ip link add "$bridge" type bridge 2>/dev/null || cannot "ip link add $bridge type bridge failed"
  ip addr add "$head_addr/24" dev "$bridge"
  ip link set "$bridge" up
  local i
  for i in $(seq "$n"); do
    make_node "$i"
  done
  write_hosts "$n"
  # The bridge forwards between the nodes (a switch): each node must reach the host and the next
  # node (a refused connection to the discard port is an answer; a timeout is not).
  for i in $(seq "$n"); do
    local peer
    for peer in "$head_addr" "$(node_addr $((i % n + 1)))"; do
      local answer
      answer="$(in_node "$i" timeout 5 bash -c "exec 3<>/dev/tcp/$peer/9" 2>&1 || true)"
      [[ "$answer" == *refused* ]] || die "$(node_name "$i") cannot reach $peer over the bridge: ${answer:-no answer in 5 s}"
    done
  done
  say "up: $n node(s) on bridge $bridge ($net.0/24, the host is $head_addr gridlm-head):"
  for i in $(seq "$n"); do
    say "  $(node_name "$i") $(node_addr "$i")"
  done
  if [ $slurm = 1 ]; then start_slurm "$n"; fi
  trap - EXIT
  exports
}

kill_node_processes() {  # index
  local name pids
  name="$(node_name "$1")"
  pids="$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ')"
  if [ -n "${pids// /}" ]; then
    say "killing the processes on $name: $pids"
    # shellcheck disable=SC2086 # one pid per word
    kill -KILL $pids 2>/dev/null || true
  fi
}

stop() {
  local n i
  n="$(nodes)"
  stop_slurm
  for i in $(seq "$n"); do
    kill_node_processes "$i"
  done
  for i in $(seq "$n"); do
    ip link del "$(host_link "$i")" 2>/dev/null || true
    ip netns del "$(node_name "$i")" 2>/dev/null || true
    umount "$(uts_file "$i")" 2>/dev/null || true
    rm -f "$(uts_file "$i")"
  done
  # Namespaces of a cluster whose state was lost (its directory removed): the names are fixed, so
  # they are this script's and would block the next start.
  local stale
  for stale in $(ip netns list 2>/dev/null | awk '$1 ~ /^gridlm-node[0-9]+$/ {print $1}'); do
    say "removing $stale, left without state"
    ip netns pids "$stale" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip link del "gridlm-n${stale#gridlm-node}" 2>/dev/null || true
    ip netns del "$stale" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  if grep -qF "$hosts_begin" /etc/hosts 2>/dev/null; then
    local tmp
    tmp="$(mktemp)"
    strip_hosts >"$tmp"
    cat "$tmp" >/etc/hosts
    rm -f "$tmp"
  fi
  rm -f "$dir/nodes"
  if [ "$n" = 0 ]; then say "not running"; else say "stopped $n node(s)"; fi
}

status() {
  local n i
  n="$(nodes)"
  if [ "$n" = 0 ]; then
    say "not up (state dir $dir)"
    return 1
  fi
  for i in $(seq "$n"); do
    local name state procs
    name="$(node_name "$i")"
    state="$(ip -n "$name" -br link show eth0 2>/dev/null | awk '{print $2}')"
    procs="$(ip netns pids "$name" 2>/dev/null | wc -l)"
    say "$name $(node_addr "$i") link ${state:-missing}, $procs process(es), qdisc: $(tc -n "$name" qdisc show dev eth0 2>/dev/null | head -n 1)"
  done
  if [ -n "$(live_pid slurmctld)" ]; then
    SLURM_CONF="$slurm_conf" timeout 10 sinfo -N -o "%N %T %c" >&2 || true
  fi
  exports
}

shape() {
  local rate="${1:-}" delay="${2:-}" n i
  [ -n "$rate" ] || die "usage: shape RATE [DELAY], e.g. shape 10gbit 20us" 2
  n="$(nodes)"
  [ "$n" != 0 ] || die "no cluster is up"
  if [ -n "$delay" ] && ! tc qdisc add dev lo root netem delay 0 2>/dev/null; then
    die "a delay needs tc netem, which this kernel lacks (CONFIG_NET_SCH_NETEM not set): links can be rate-limited (shape $rate) but not delayed"
  fi
  [ -n "$delay" ] && tc qdisc del dev lo root 2>/dev/null
  # tbf's bucket: 1 ms at the rate (at least 32 KiB, a few packets): tbf needs a bucket it can fill
  # between timer ticks to reach the rate, and a larger one lets bursts through unshaped (a bucket
  # of 2 MB passed a pipeline's 1 MB sends at the bridge's own speed at 500 Mbit/s).
  local burst
  burst="$(rate_bytes_per_s "$rate")" || die "RATE '$rate' is not a tc rate (e.g. 500mbit, 10gbit)" 2
  burst="$(( burst / 1000 > 32768 ? burst / 1000 : 32768 ))b"
  # Both ends of every node's link, so that each direction is limited: a node's sends leave by its
  # eth0, what it receives leaves the bridge by the host's end.
  for i in $(seq "$n"); do
    local name link
    name="$(node_name "$i")" link="$(host_link "$i")"
    if [ -n "$delay" ]; then
      tc -n "$name" qdisc replace dev eth0 root netem delay "$delay" rate "$rate"
      tc qdisc replace dev "$link" root netem delay "$delay" rate "$rate"
    else
      tc -n "$name" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
      tc qdisc replace dev "$link" root tbf rate "$rate" burst "$burst" latency 50ms
    fi
  done
  say "every node's link limited to $rate${delay:+ with $delay delay} each way"
}

# Bytes per second of a tc rate (500mbit, 10gbit, 1.5gbit, 100kbit, 12500000bps); fails on others.
rate_bytes_per_s() {
  awk -v r="$1" 'BEGIN {
    if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
    n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
    if (u == "bit") f = 1 / 8; else if (u == "kbit") f = 1e3 / 8; else if (u == "mbit") f = 1e6 / 8
    else if (u == "gbit") f = 1e9 / 8; else if (u == "bps") f = 1; else if (u == "kbps") f = 1e3
    else if (u == "mbps") f = 1e6; else if (u == "gbps") f = 1e9; else exit 1
    printf "%d\n", n * f }'
}

unshape() {
  local i
  for i in $(seq "$(nodes)"); do
    tc -n "$(node_name "$i")" qdisc del dev eth0 root 2>/dev/null || true
    tc qdisc del dev "$(host_link "$i")" root 2>/dev/null || true
  done
  say "links unlimited"
}

link() {
  local i state="${2:-}"
  [ $# -ge 2 ] || die "usage: link NODE down|up" 2
  i="$(node_index "$1")"
  [[ "$state" =~ ^(down|up)$ ]] || die "usage: link NODE down|up" 2
  ip -n "$(node_name "$i")" link set eth0 "$state"
  say "$(node_name "$i"): link $state"
}

# --- Slurm: slurmctld on the host (gridlm-head), one slurmd inside each node's namespaces -------

live_pid() {  # daemon name [node]
  local pid file="$slurm_dir/$1${2:+-$2}.pid"
  pid="$(cat "$file" 2>/dev/null || true)"
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$1" ] && echo "$pid"
}

write_slurm_conf() {
  local n="$1"
  mkdir -p "$slurm_dir/state" "$slurm_dir/log"
  cat >"$slurm_conf" <<EOF
# Written by launch/cluster_local.sh: a Slurm over the simulated nodes. Edits are overwritten by 'start'.
ClusterName=gridlm-cluster
SlurmctldHost=$(hostname -s)($head_addr)
SlurmctldPort=$ctld_port
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=5
StateSaveLocation=$slurm_dir/state
SlurmdSpoolDir=$slurm_dir/spool-%n
SlurmctldPidFile=$slurm_dir/slurmctld.pid
SlurmdPidFile=$slurm_dir/slurmd-%n.pid
SlurmctldLogFile=$slurm_dir/log/slurmctld.log
SlurmdLogFile=$slurm_dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=gridlm-node[1-$n] NodeAddr=$net.[11-$((10 + n))] CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=gridlm-node[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

slurm_nodes_up() {  # n
  local states
  states="$(SLURM_CONF="$slurm_conf" timeout 10 sinfo -h -N -o %T 2>/dev/null || true)"
  [ "$(grep -cE '^(idle|mixed|allocated|completing)$' <<<"$states")" = "$1" ]
}

start_slurm() {
  local n="$1" i t0=$SECONDS
  if ! command -v slurmd >/dev/null 2>&1 || ! command -v slurmctld >/dev/null 2>&1; then
    # The one-node script installs Slurm and munge (apt) and exits 3 where it cannot.
    "$here/slurm_local.sh" install >&2 || { say "no Slurm here: the mpirun path only"; return 0; }
  fi
  "$here/slurm_local.sh" munge >&2 || { say "munge did not start: the mpirun path only"; return 0; }
  [ -n "$(live_pid slurmctld)" ] || write_slurm_conf "$n"
  if [ -z "$(live_pid slurmctld)" ]; then
    setsid slurmctld -D -f "$slurm_conf" </dev/null >>"$slurm_dir/log/slurmctld.out" 2>&1 &
  fi
  for i in $(seq "$n"); do
    if [ -z "$(live_pid slurmd "$(node_name "$i")")" ]; then
      # slurmd takes its node name from the hostname: the node's UTS namespace says gridlm-nodeI.
      # Each node reads slurm.conf from a directory of its own, beside an mpi.conf that gives its
      # PMIx client directories a base of their own: the nodes share /tmp, where two slurmstepds
      # of one step would otherwise both create /tmp/spmix_appdir_UID_JOB.STEP (and one fail).
      local name node_dir
      name="$(node_name "$i")" node_dir="$slurm_dir/$(node_name "$i")"
      mkdir -p "$node_dir/tmp" "$slurm_dir/spool-$name"
      cp "$slurm_conf" "$node_dir/slurm.conf"
      echo "PMIxCliTmpDirBase=$node_dir/tmp" >"$node_dir/mpi.conf"
      SLURM_CONF="$node_dir/slurm.conf" in_node "$i" setsid slurmd -D -f "$node_dir/slurm.conf" </dev/null \
        >>"$slurm_dir/log/slurmd-$name.out" 2>&1 &
    fi
  done
  local resumed=0
  while [ $((SECONDS - t0)) -lt 30 ]; do
    slurm_nodes_up "$n" && break
    if [ $resumed = 0 ] && [ $((SECONDS - t0)) -ge 3 ]; then
      SLURM_CONF="$slurm_conf" scontrol update NodeName="gridlm-node[1-$n]" State=RESUME >/dev/null 2>&1 || true
      resumed=1
    fi
    sleep 0.5
  done
  if ! slurm_nodes_up "$n"; then
    tail -n 20 "$slurm_dir"/log/*.log >&2 || true
    die "the cluster's Slurm did not come up within 30 s; logs in $slurm_dir/log"
  fi
  say "Slurm up in $((SECONDS - t0)) s: slurmctld on gridlm-head:$ctld_port, slurmd on gridlm-node[1-$n], partition debug"
}

stop_slurm() {
  local name pid i
  if [ -n "$(live_pid slurmctld)" ]; then
    local jobs
    jobs="$(SLURM_CONF="$slurm_conf" timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)"
    if [ -n "${jobs// /}" ]; then
      say "cancelling jobs $jobs"
      # shellcheck disable=SC2086 # one job id per word
      SLURM_CONF="$slurm_conf" scancel $jobs 2>/dev/null || true
    fi
  fi
  for i in $(seq "$(nodes)"); do
    pid="$(live_pid slurmd "$(node_name "$i")" || true)"
    [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true
  done
  pid="$(live_pid slurmctld || true)"
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do
      [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = slurmctld ] || break
      sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$slurm_dir"/*.pid
}

case "${1:-}" in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  exec)
    shift
    [ $# -ge 2 ] || die "usage: exec NODE CMD..." 2
    i="$(node_index "$1")"; shift
    in_node "$i" "$@"
    ;;
  shape) shift; shape "$@" ;;
  unshape) unshape ;;
  link) shift; link "$@" ;;
  *)
    sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
