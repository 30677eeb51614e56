#!/bin/bash
#PBS -N {{job_name}}
#PBS -l select={{nodes}}:system=polaris
#PBS -l place=scatter
#PBS -l walltime={{time}}
#PBS -j oe
#PBS -k doe
#PBS -o {{output}}
#PBS -S /bin/bash
{{directives}}
# gridlm on ALCF Polaris: {{nodes}} node(s) x 4 A100 = {{ranks}} ranks, one GPU per rank.
# Written by launch/submit.py from launch/jobs/polaris.sh (writing it again overwrites this file).
# -j oe -k doe -o DIR/: one log, written into the run directory while the job runs.
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
# PBS starts a job in $HOME, not where qsub ran: go to the directory submit.py ran in.
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}
# PBS has no --signal: SIGUSR1 to this script {{signal_lead_s}} s before the walltime ({{time}}); common.sh
# passes it to mpiexec, the ranks checkpoint and exit 0, a resubmitted job resumes (run.resume: auto).
gridlm_signal_before_end {{time_seconds}} {{signal_lead_s}}

# ALCF's conda module: python with torch (CUDA), mpi4py and h5py for Cray MPICH.
if command -v module >/dev/null 2>&1; then
  module use /soft/modulefiles
  module load conda
  conda activate
fi
# gridlm's MPI traffic is host memory only (tensors go through NCCL); 1 would make MPI_Init fail
# unless mpi4py is linked with the GTL library.
export MPICH_GPU_SUPPORT_ENABLED=0
# NCCL over Slingshot through aws-ofi-nccl: GRIDLM_NCCL_PLUGIN = its lib directory (ALCF keeps
# builds in /soft/libraries/aws-ofi-nccl/). NCCL_NET makes a missing plugin an error.
# ALCF's builds of the plugin link ALCF's hwloc, which is not on the default library path: without it
# the plugin does not load, and NCCL_NET stops the job ("network AWS Libfabric not found").
if [ -n "${GRIDLM_NCCL_PLUGIN:-}" ]; then
  export LD_LIBRARY_PATH="$GRIDLM_NCCL_PLUGIN:${LD_LIBRARY_PATH:-}"
  if [ -d /soft/libraries/hwloc/lib ]; then
    export LD_LIBRARY_PATH="/soft/libraries/hwloc/lib:$LD_LIBRARY_PATH"
  fi
fi
export NCCL_NET="AWS Libfabric"
export NCCL_NET_GDR_LEVEL=PHB             # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                   # rings may leave through another NIC (Slingshot is not rail-wired)
export FI_CXI_DISABLE_HOST_REGISTER=1     # avoids deadlocks between cudaMalloc and CXI registration
export FI_MR_CACHE_MONITOR=userfaultfd    # libfabric memory-registration cache monitor that is safe with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072      # large completion queues for many-node collectives
export OMP_NUM_THREADS={{threads}}  # = mpiexec --depth: the cores of one rank
# torch.distributed's start-up store listens on rank 0's node (this one); the other ranks reach
# it through its hostname. If that resolves to an address they cannot reach, set another one:
# export GRIDLM_MASTER_ADDR=<address of this node on the high-speed network>

# Checkpoints ({{checkpoint_gb}} GB each) on Eagle (Lustre, 160 OSTs): ALCF publishes no striping for one
# large shared file, so the layout is Eagle's own; GRIDLM_STRIPE="-c N -S SIZE" sets one.
gridlm_stripe {{checkpoint_dir}} {{setstripe}}

# Python: the venv of launch/setup.sh if there is one; otherwise the conda module's python, which
# must provide torch (CUDA build), mpi4py and h5py built against Cray MPICH.
# The repository goes on PYTHONPATH; the check stops the job in seconds if an import fails.
gridlm_use_venv
gridlm_check_python {{launch}}

# all-visible binding: mpiexec binds no GPUs; each rank sees 4 and its local rank picks one. GPU
# indices run opposite to the NUMA domains that --cpu-bind depth hands out (local rank 0 gets the
# cores next to GPU 3: ALCF's affinity script assigns GPU 3 - local rank), so the order is reversed.
export GRIDLM_GPU_ORDER=3,2,1,0
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
