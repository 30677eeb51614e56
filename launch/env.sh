# Sourced by launch/*.sh: the venv on PATH, and OpenMPI settings for small shared machines.
# Nothing here is needed on a supercomputer where the site's MPI is configured.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="${GRIDLM_VENV:-$repo/.venv}/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$(id -u)" = 0 ]; then
  # OpenMPI refuses to run as root (containers, CI) unless told it is deliberate.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores (4 ranks on a 2-core CI machine), and no CMA inside containers.
export OMPI_MCA_rmaps_base_oversubscribe="${OMPI_MCA_rmaps_base_oversubscribe:-1}"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
# OpenMPI's MPI-IO: ROMIO, not OMPIO. Measured with benchmarks/checkpoint_bench.py on this kind of
# machine, OMPIO's collective writes of the many per-tensor checkpoint datasets ran 2-5x slower.
export OMPI_MCA_io="${OMPI_MCA_io:-romio321}"
# PMIx authenticates with munge first where libmunge is installed (the local Slurm's, launch/
# slurm_local.sh) and, while no munged answers, retries for 2 s before it falls back: every MPI start
# (mpirun, a singleton's MPI_Init) waited so. Measured on this kind of machine: `mpirun -n 1 true`
# 2.31 s with munge, 0.33 s with native (uid) authentication, which a single host's ranks need.
export PMIX_MCA_psec="${PMIX_MCA_psec:-native}"
