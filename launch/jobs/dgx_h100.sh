#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node={{ranks_per_node}}
#SBATCH --gpus-per-node={{ranks_per_node}}
#SBATCH --exclusive
#SBATCH --time={{time}}
#SBATCH --output={{output}}
#SBATCH --signal=B:USR1@{{signal_lead_s}}
{{directives}}
# gridlm on {{machine}}: {{nodes}} DGX node(s) x {{ranks_per_node}} GPUs = {{ranks}} ranks, one GPU per rank.
# Written by launch/submit.py from launch/jobs/dgx_h100.sh (writing it again overwrites this file).
# --signal: Slurm sends SIGUSR1 to this script {{signal_lead_s}} s before the time limit; common.sh passes
# it to srun, the ranks checkpoint and exit 0, and a resubmitted job resumes (run.resume: auto).
# With pyxis/enroot, add --container-image=IMAGE to the srun line below (machine file: launch).
set -eo pipefail
repo={{repo}}
source "$repo/launch/jobs/common.sh"
cd {{workdir}}
gridlm_start {{nodes}} {{ranks}}

# NCCL between nodes: InfiniBand through the ConnectX HCAs (GPU-direct RDMA, one HCA per GPU).
# If the storage or management NICs are mlx5 too, list the compute ones: mlx5_0,mlx5_1,... (ibstat).
export NCCL_IB_HCA="${NCCL_IB_HCA:-mlx5}"
export OMP_NUM_THREADS={{threads}}  # = srun -c: the cores of one rank
# torch.distributed's start-up store listens on rank 0's node (this one); the other ranks reach
# it through its hostname. If that resolves to an address they cannot reach, set another one:
# export GRIDLM_MASTER_ADDR=<address of this node on the high-speed network>

# Checkpoints ({{checkpoint_gb}} GB each): a DGX cluster's storage is the site's choice (Lustre, GPFS, Weka,
# NFS); on Lustre set GRIDLM_STRIPE="-c N -S SIZE" for the layout its vendor recommends.
gridlm_stripe {{checkpoint_dir}} {{setstripe}}

# Python: the venv of launch/setup.sh if there is one; otherwise the python of your modules,
# conda env or container, which must provide torch (CUDA build), mpi4py and h5py built against
# the MPI that srun --mpi=pmix starts (OpenMPI / HPC-X). The repository goes on PYTHONPATH; the
# check stops the job in seconds if an import fails; with --container-image on the srun line the
# python is the image's, not this node's, and the check is skipped.
gridlm_use_venv
gridlm_check_python {{launch}}

# all-visible binding: each rank sees the node's GPUs (NCCL P2P over NVSwitch); local rank picks.
gridlm_launch {{launch}} python -m app {{deck}} {{overrides}}
