#!/usr/bin/env bash
# Run a deck on this machine: setup if needed, then `mpirun -n RANKS python -m app DECK`.
#   launch/local.sh inputs/gpt_tiny.yaml [--set section.key=value ...]
#   RANKS=1 launch/local.sh inputs/gpt_tiny.yaml      (default RANKS=4)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: launch/local.sh DECK [--set section.key=value ...]   (RANKS=N to change the rank count, default 4)" >&2
  exit 2
fi
# Checked before setup and mpirun: `mpirun -n 0` takes every slot, and a negative or non-numeric
# count ends in Open MPI's multi-line banner. Set but empty is refused too, not read as the default.
ranks="${RANKS-4}"
if ! [[ "$ranks" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/local.sh: RANKS='$ranks': not a positive integer; set RANKS=N with N >= 1, e.g. RANKS=2 (or unset it for 4)" >&2
  exit 2
fi
"$here/setup.sh"
source "$here/env.sh"
# In the caller's directory: the deck's path and a relative run.dir mean there what they mean to
# `python -m app` (gridlm is installed in the venv, importable from anywhere).
exec mpirun -n "$ranks" python -m app "$@"
