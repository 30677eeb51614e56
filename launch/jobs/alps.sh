#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node={{ranks_per_node}}
#SBATCH --time={{time}}
#SBATCH --output={{output}}
#SBATCH --signal=B:USR1@{{signal_lead_s}}
{{directives}}
# gridlm on CSCS Alps: {{nodes}} node(s) x 4 GH200 = {{ranks}} ranks, one Hopper GPU per rank.
# Written by launch/submit.py from launch/jobs/alps.sh (writing it again overwrites this file).
# --signal: Slurm sends SIGUSR1 to this script {{signal_lead_s}} s before the time limit; common.sh passes
# it to srun, the ranks checkpoint and exit 0, and a resubmitted job resumes (run.resume: auto).
# Software comes from a uenv or a container: pass it to sbatch, e.g.
#   sbatch --uenv=pytorch/v2.6.0:v1 --view=default THIS_FILE   (or --environment=EDF for a container)
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}

# gridlm's MPI traffic is host memory only (tensors go through NCCL); 1 would make MPI_Init fail
# unless mpi4py is linked with the GTL library.
export MPICH_GPU_SUPPORT_ENABLED=0
# NCCL over Slingshot through aws-ofi-nccl; GRIDLM_NCCL_PLUGIN = its lib directory if the uenv or
# image does not provide it. NCCL_NET makes a missing plugin an error, not a fall-back to sockets.
if [ -n "${GRIDLM_NCCL_PLUGIN:-}" ]; then
  export LD_LIBRARY_PATH="$GRIDLM_NCCL_PLUGIN:${LD_LIBRARY_PATH:-}"
fi
export NCCL_NET="AWS Libfabric"
export NCCL_NET_GDR_LEVEL=PHB             # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                   # rings may leave through another NIC (Slingshot is not rail-wired)
export FI_CXI_DISABLE_HOST_REGISTER=1     # avoids deadlocks between cudaMalloc and CXI registration
export FI_MR_CACHE_MONITOR=userfaultfd    # libfabric memory-registration cache monitor that is safe with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072      # large completion queues for many-node collectives
export FI_CXI_DEFAULT_TX_SIZE=32768       # CSCS: set for correctness and performance with NCCL on Alps
export FI_CXI_RX_MATCH_MODE=software      # CSCS: message matching in software, no hardware-list overflow
# LL128 corrupts data silently on GH200 over Slingshot: the NIC writes through NVLink-C2C and a 128-byte
# line's flag can land before its data (NVIDIA/nccl#2001, fix in #2053); NCCL >= 2.27 enables it there.
# CSCS sets NCCL_PROTO=^LL128 (docs.cscs.ch, NCCL). An explicit NCCL_PROTO is kept.
export NCCL_PROTO="${NCCL_PROTO:-^LL128}"
export OMP_NUM_THREADS={{threads}}  # = srun -c: the 72 Grace cores of one superchip
# torch.distributed's start-up store listens on rank 0's node (this one); the other ranks reach
# it through its hostname. If that resolves to an address they cannot reach, set another one:
# export GRIDLM_MASTER_ADDR=<address of this node on the high-speed network>

# Checkpoints ({{checkpoint_gb}} GB each) on Capstor (Lustre; CSCS recommends it for checkpoints,
# docs.cscs.ch/platforms/mlp): CSCS's layout for large files, 32 stripes of 4 MB (docs.cscs.ch/guides/storage).
gridlm_stripe {{checkpoint_dir}} {{setstripe}}

# Python: the venv of launch/setup.sh if there is one (create it inside the uenv); otherwise the
# uenv's or image's python, which must provide torch, mpi4py and h5py built against Cray MPICH.
# The repository goes on PYTHONPATH; the check stops the job in seconds if an import fails (skipped
# where the launch line starts a container: --container-image, --environment).
gridlm_use_venv
gridlm_check_python {{launch}}

# all-visible binding: each rank sees the node's 4 GPUs (NCCL P2P over NVLink); local rank picks.
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
