#!/usr/bin/env bash
# mpirun's "ssh" to a simulated node of launch/cluster_local.sh (OMPI_MCA_plm_rsh_agent):
# called as `cluster_rsh.sh [ssh options] HOST COMMAND...`, it runs COMMAND (a shell command line,
# as ssh would hand it to the remote shell) inside HOST's network and UTS namespaces.
set -euo pipefail
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do
  case "$1" in
    -x | -X | -T | -t | -q | -n) shift ;;
    *) shift; [ $# -gt 0 ] && shift ;;  # an option with a value (-p 22, -o Opt=...)
  esac
done
[ $# -ge 2 ] || { echo "cluster_rsh.sh: usage: cluster_rsh.sh [options] HOST COMMAND..." >&2; exit 255; }
host="${1#*@}"; shift
dir="${GRIDLM_CLUSTER_DIR:-/tmp/gridlm-cluster}"
if [ ! -e "/run/netns/$host" ] || [ ! -e "$dir/uts/$host" ]; then
  echo "cluster_rsh.sh: $host is not a node of launch/cluster_local.sh (state in $dir); known: $(ls "$dir/uts" 2>/dev/null | tr '\n' ' ')" >&2
  exit 255
fi
# What mpirun set for itself is not the remote side's business; a real ssh starts clean of it
# (settings, OMPI_MCA_* and PMIX_MCA_* from launch/env.sh, are kept: the nodes run the same way).
while IFS='=' read -r name _; do
  case "$name" in OMPI_MCA_* | PMIX_MCA_* | OMPI_ALLOW_RUN_AS_ROOT*) ;; OMPI_* | PMIX_* | OPAL_* | ORTE_*) unset "$name" ;; esac
done < <(env)
exec nsenter --net="/run/netns/$host" --uts="$dir/uts/$host" -- /bin/sh -c "$*"
