#!/bin/bash
# launch/srun.sh: run an hpc_rlhf mode on every task of a Slurm allocation, one rank per task, started by srun.
#
# Needs: to run inside an allocation (an sbatch script or an salloc shell) and, on every node, a python with
# hpc_rlhf installed (PYTHON, or CONTAINER for an Apptainer image: see launch/env.sh). Rank, world size, node
# list and master address come from srun's SLURM_* variables; the port from the job id unless MASTER_PORT is set.
#
#   launch/srun.sh sft --config my_sft.yaml train.lr=1e-5
#   launch/srun.sh --ntasks=16 --ntasks-per-node=8 -- ppo --config my_ppo.yaml placement=...   # srun options, --
#   PYTHON=.venv/bin/python launch/srun.sh --mpi=pmix -- sft --config examples/tiny/sft.yaml dist.nproc=4
#
# Each rank runs `python -m hpc_rlhf.launch.slurm rank MODE ...`: `python -m hpc_rlhf MODE ...` with a clean exit
# code 75 once a preempted rank has written its checkpoint. --kill-on-bad-exit=1: one failed rank ends the step at
# once instead of leaving the others in a collective until its timeout. The exit code is srun's; 75 means every
# rank checkpointed and stopped (sbatch/common.sh then requeues the job). Works from any folder; relative paths
# in the arguments are read from the current one. The sbatch scripts (sbatch/*.sbatch) run their ranks with it.
set -o pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/env.sh"

hpc_split_args "$@"
hpc_need_mode "launch/srun.sh [SRUN_OPTION ... --] MODE [--config FILE.yaml] [key=value ...]"
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "launch/srun.sh: not inside a Slurm allocation (SLURM_JOB_ID is not set): run it in an sbatch script or" \
       "an salloc shell, or use launch/local.sh, launch/torchrun.sh or launch/mpirun.sh" >&2
  exit 2
fi
hpc_python || exit 2
hpc_rank_env
hpc_store_secret  # srun gives every task this environment: one secret for the job
exec srun --kill-on-bad-exit=1 ${HPC_LAUNCHER_ARGS[@]+"${HPC_LAUNCHER_ARGS[@]}"} "${HPC_PYTHON[@]}" \
  -m hpc_rlhf.launch.slurm rank "${HPC_MODE_ARGS[@]}"
