#!/bin/bash
# launch/local.sh: run an hpc_rlhf mode on this machine alone; the mode starts the ranks its config needs.
#
# Needs: a python with hpc_rlhf installed (PYTHON or CONTAINER: see launch/env.sh); no cluster, no launcher.
# A mode that needs N > 1 ranks (its placement, or dist.nproc) starts them here: forks of one process with a
# CPU-only torch, fresh interpreters with a CUDA build (HPC_RLHF_LOCAL_FORK=0: always fresh interpreters).
#
#   launch/local.sh sft --config examples/tiny/sft.yaml dist.nproc=2
#   launch/local.sh ppo --config examples/tiny/ppo.yaml          # 6 roles on 6 local ranks
#
# The variables of an outer launcher (an interactive `srun --pty bash`, a torchrun or mpirun environment) are
# dropped first, so that the world is always this machine's. Works from any folder; relative paths in the
# arguments are read from the current one.
set -o pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/env.sh"

if [ "$#" -eq 0 ]; then
  echo "usage: launch/local.sh MODE [--config FILE.yaml] [key=value ...]" >&2
  exit 2
fi
hpc_python || exit 2
# What hpc_rlhf.dist.launch_env.detect_launch reads to decide that another launcher made the world.
unset RANK WORLD_SIZE SLURM_STEP_ID SLURM_STEPID OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE PMI_RANK PMI_SIZE PMIX_RANK
exec "${HPC_PYTHON[@]}" -m hpc_rlhf "$@"
