#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node={{ranks_per_node}}
#SBATCH --gpus-per-node={{ranks_per_node}}
#SBATCH --time={{time}}
#SBATCH --output={{output}}
#SBATCH --signal=B:USR1@{{signal_lead_s}}
{{directives}}
# gridlm on NERSC Perlmutter: {{nodes}} node(s) x 4 A100 = {{ranks}} ranks, one GPU per rank.
# Written by launch/submit.py from launch/jobs/perlmutter.sh (writing it again overwrites this file).
# --signal: Slurm sends SIGUSR1 to this script {{signal_lead_s}} s before the time limit; common.sh passes
# it to srun, the ranks checkpoint and exit 0, and a resubmitted job resumes (run.resume: auto).
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}

# CUDA, parallel HDF5 (h5py's mpio driver) and NERSC's NCCL with the aws-ofi-nccl plugin.
# (`module load pytorch` instead brings torch, mpi4py and the plugin in one module.)
if command -v module >/dev/null 2>&1; then
  module load cudatoolkit cray-hdf5-parallel nccl
fi
# gridlm's MPI traffic is host memory only (tensors go through NCCL); 1 would make MPI_Init fail
# unless mpi4py is linked with the GTL library.
export MPICH_GPU_SUPPORT_ENABLED=0
# NCCL over Slingshot through aws-ofi-nccl; GRIDLM_NCCL_PLUGIN = its lib directory if no module
# provides it. NCCL_NET makes a missing plugin an error instead of a silent fall-back to sockets.
if [ -n "${GRIDLM_NCCL_PLUGIN:-}" ]; then
  export LD_LIBRARY_PATH="$GRIDLM_NCCL_PLUGIN:${LD_LIBRARY_PATH:-}"
fi
export NCCL_NET="AWS Libfabric"
export NCCL_SOCKET_IFNAME=hsn             # NCCL bootstrap over Slingshot, not the management net
export NCCL_NET_GDR_LEVEL=PHB             # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                   # rings may leave through another NIC (Slingshot is not rail-wired)
export FI_CXI_DISABLE_HOST_REGISTER=1     # avoids deadlocks between cudaMalloc and CXI registration
export FI_MR_CACHE_MONITOR=userfaultfd    # libfabric memory-registration cache monitor that is safe with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072      # large completion queues for many-node collectives
export OMP_NUM_THREADS={{threads}}  # physical cores per rank (srun -c counts 2 hardware threads per core)
# torch.distributed's start-up store listens on rank 0's node (this one); the other ranks reach
# it through its hostname. If that resolves to an address they cannot reach, set another one:
# export GRIDLM_MASTER_ADDR=<address of this node on the high-speed network>

# Checkpoints ({{checkpoint_gb}} GB each) on Perlmutter scratch (all-flash Lustre, default 1 OST): NERSC's
# single-shared-file advice is stripe_small (8 OSTs) from 1 GB, stripe_medium (24) from 10 GB, stripe_large (72)
# above 100 GB (docs.nersc.gov/performance/io/lustre/); the stripe size stays the file system's.
gridlm_stripe {{checkpoint_dir}} {{setstripe}}

# Python: the venv of launch/setup.sh if there is one; otherwise the python of your modules or
# conda env, which must provide torch (CUDA build), mpi4py and h5py built against Cray MPICH.
# The repository goes on PYTHONPATH; the check stops the job in seconds if an import fails.
gridlm_use_venv
gridlm_check_python {{launch}}

# all-visible binding: each rank sees the node's 4 GPUs (NCCL P2P over NVLink); local rank picks. GPU
# indices run opposite to the NUMA domains that -c 32 --cpu-bind=cores hands out (local rank 0 gets cores
# 0-15, next to GPU 3: `nvidia-smi topo -m`; NERSC's and WarpX's Perlmutter scripts set
# CUDA_VISIBLE_DEVICES=$((3-SLURM_LOCALID))), so the order is reversed, as on Polaris.
export GRIDLM_GPU_ORDER=3,2,1,0
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
