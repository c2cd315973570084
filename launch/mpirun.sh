#!/bin/bash
# launch/mpirun.sh: run an hpc_rlhf mode on ranks started by mpirun (Open MPI, MPICH, Intel MPI).
#
# Needs: mpirun on PATH and, on every node, a python with hpc_rlhf and mpi4py built against this MPI (the `mpi`
# extra; PYTHON or CONTAINER: see launch/env.sh). MPI only bootstraps: rank and world size come from the MPI
# launcher, rank 0's address and a free port reach the others through mpi4py (not needed when MASTER_ADDR and
# MASTER_PORT are set); the data moves over NCCL (GPU) or gloo (CPU), never over MPI.
#
#   launch/mpirun.sh -n 4 -- sft --config examples/tiny/sft.yaml dist.nproc=4      # mpirun options, then --
#   launch/mpirun.sh -n 16 --map-by ppr:8:node -- ppo --config my_ppo.yaml placement=...
#
# Inside a Slurm allocation mpirun takes the allocation's nodes (launch/srun.sh with --mpi=pmix works too).
# Outside one, Open MPI starts remote ranks over ssh without this shell's environment: pass what the ranks need
# with -x (e.g. -x NCCL_SOCKET_IFNAME -x OMP_NUM_THREADS). As root, Open MPI also wants
# OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1. Works from any folder; relative paths in the
# arguments are read from the current one.
set -o pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/env.sh"

hpc_split_args "$@"
hpc_need_mode "launch/mpirun.sh [MPIRUN_OPTION ... --] MODE [--config FILE.yaml] [key=value ...]"
command -v mpirun >/dev/null || { echo "launch/mpirun.sh: mpirun is not on PATH (module load openmpi?)" >&2; exit 2; }
hpc_python || exit 2
hpc_rank_env
exec mpirun ${HPC_LAUNCHER_ARGS[@]+"${HPC_LAUNCHER_ARGS[@]}"} "${HPC_PYTHON[@]}" -m hpc_rlhf "${HPC_MODE_ARGS[@]}"
