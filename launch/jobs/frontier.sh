#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --time={{time}}
#SBATCH --output={{output}}
#SBATCH --signal=B:USR1@{{signal_lead_s}}
#SBATCH --network=disable_rdzv_get
{{directives}}
# gridlm on OLCF Frontier: {{nodes}} node(s) x 8 MI250X GCDs = {{ranks}} ranks, one GCD per rank.
# Written by launch/submit.py from launch/jobs/frontier.sh (writing it again overwrites this file).
# --signal: Slurm sends SIGUSR1 to this script {{signal_lead_s}} s before the time limit; common.sh passes
# it to srun, the ranks checkpoint and exit 0, and a resubmitted job resumes (run.resume: auto).
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}

# ROCm, the AMD GPU target of the Cray wrappers and parallel HDF5 (h5py's mpio driver). Pin the
# ROCm version that your torch wheel was built for, e.g. rocm/6.2.4 for a +rocm6.2 wheel.
if command -v module >/dev/null 2>&1; then
  module load PrgEnv-gnu rocm craype-accel-amd-gfx90a cray-hdf5-parallel
fi
# gridlm's MPI traffic is host memory only (tensors go through RCCL); 1 would make MPI_Init fail
# unless mpi4py is linked with the GTL library.
export MPICH_GPU_SUPPORT_ENABLED=0
# RCCL reaches Slingshot through the aws-ofi-nccl plugin. OLCF's rccl-net-plugin module (loaded after rocm)
# provides it with the Slingshot settings OLCF calls critical for RCCL's correctness, among them
# FI_CXI_RDZV_PROTO=alt_read, which needs the allocation's --network=disable_rdzv_get above
# (docs.olcf.ornl.gov, PyTorch on Frontier). GRIDLM_RCCL_PLUGIN = the lib directory of your own build instead.
if [ -n "${GRIDLM_RCCL_PLUGIN:-}" ]; then
  export LD_LIBRARY_PATH="$GRIDLM_RCCL_PLUGIN:${LD_LIBRARY_PATH:-}"
elif command -v module >/dev/null 2>&1 && module load rccl-net-plugin; then
  echo "gridlm-job: RCCL network plugin: module rccl-net-plugin"
else
  echo "gridlm-job: warning: no module rccl-net-plugin and GRIDLM_RCCL_PLUGIN is unset: without the plugin RCCL uses TCP sockets" >&2
fi
export NCCL_SOCKET_IFNAME=hsn0            # RCCL bootstrap over the Slingshot NIC, not the management net
export NCCL_NET_GDR_LEVEL=3               # GPU-direct RDMA between GCDs and NICs (OLCF recommendation)
export FI_CXI_ATS=0                       # avoids hangs of the CXI provider with RCCL (OLCF)
export FI_MR_CACHE_MONITOR=userfaultfd    # libfabric memory-registration cache: no deadlock with hipMalloc
export FI_CXI_DEFAULT_CQ_SIZE=131072      # large completion queues for many-node collectives
export OMP_NUM_THREADS={{threads}}  # = srun -c: the cores of one rank
# torch.distributed's start-up store listens on rank 0's node (this one); the other ranks reach
# it through its hostname. If that resolves to an address they cannot reach, set another one:
# export GRIDLM_MASTER_ADDR=<address of this node on the high-speed network>

# Checkpoints ({{checkpoint_gb}} GB each) on Orion (Lustre): OLCF asks for manual striping only of files over
# 512 GB, in the capacity pool with 16 MB stripes: 8 OSTs from 512 GB, 16 from 1 TB, 64 from 8 TB, 128 from 16 TB
# (docs.olcf.ornl.gov/data/index.html); below that Orion's progressive layout is left alone.
gridlm_stripe {{checkpoint_dir}} {{setstripe}}

# Python: the venv of launch/setup.sh if there is one; otherwise the python of your modules or
# conda env, which must provide torch (ROCm build), mpi4py and h5py built against Cray MPICH.
# The repository goes on PYTHONPATH; the check stops the job in seconds if an import fails.
gridlm_use_venv
gridlm_check_python {{launch}}

# per-task binding: each rank sees the one GCD closest to its cores, as device 0.
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
