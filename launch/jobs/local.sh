#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node={{ranks_per_node}}
#SBATCH --time={{time}}
#SBATCH --output={{output}}
#SBATCH --signal=B:USR1@{{signal_lead_s}}
{{directives}}
# gridlm on this machine's Slurm (launch/slurm_local.sh start): {{ranks}} CPU ranks (gloo).
# Written by launch/submit.py from launch/jobs/local.sh (writing it again overwrites this file).
# --signal: Slurm sends SIGUSR1 to this script {{signal_lead_s}} s before the time limit; common.sh passes
# it to srun, the ranks checkpoint and exit 0, and a resubmitted job resumes (run.resume: auto).
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}

# The venv of launch/setup.sh on PATH, and the OpenMPI settings of a small shared machine:
# run as root, more ranks than cores, no CMA single-copy, ROMIO for MPI-IO.
source "$repo/launch/env.sh"
gridlm_use_venv       # the repository on PYTHONPATH
gridlm_check_python {{launch}}   # stop at once if python cannot import app, torch, mpi4py, h5py
export OMP_NUM_THREADS={{threads}}  # the ranks share the node's few cores

# srun --mpi=pmix starts Debian's OpenMPI ranks directly (no mpirun); no devices to bind.
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
