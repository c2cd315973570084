#!/bin/bash
# launch/torchrun.sh: run an hpc_rlhf mode on ranks started by torchrun (torch.distributed.run).
#
# Needs: a python with hpc_rlhf installed (PYTHON or CONTAINER: see launch/env.sh); torchrun comes with torch.
# torchrun's agent serves the rendezvous store and outlives the ranks, so a lost rank is named by the others.
#
#   NPROC=4 launch/torchrun.sh sft --config examples/tiny/sft.yaml dist.nproc=4     # one node, 4 ranks
#   launch/torchrun.sh --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node1:29500 \
#       -- ppo --config my_ppo.yaml placement=...                                 # run on each node
#
# Without torchrun options (nothing before `--`): --standalone --nproc_per_node=$NPROC, one node. Every rank
# runs `python -m hpc_rlhf MODE ...`. Works from any folder; relative paths in the arguments are read from the
# current one.
set -o pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/env.sh"

hpc_split_args "$@"
hpc_need_mode "[NPROC=N] launch/torchrun.sh [TORCHRUN_OPTION ... --] MODE [--config FILE.yaml] [key=value ...]"
if [ "${#HPC_LAUNCHER_ARGS[@]}" -eq 0 ]; then
  if [ -z "${NPROC:-}" ]; then
    echo "launch/torchrun.sh: set NPROC (ranks on this node) or give torchrun's options before --" >&2
    exit 2
  fi
  HPC_LAUNCHER_ARGS=(--standalone "--nproc_per_node=$NPROC")
fi
hpc_python || exit 2
hpc_rank_env
# One node: the secret is made here. Several: each node's torchrun.sh must get the same one (export it, or run
# under sbatch, whose script made it).
if [[ " ${HPC_LAUNCHER_ARGS[*]} " == *" --standalone "* ]]; then hpc_store_secret; fi
exec "${HPC_PYTHON[@]}" -m torch.distributed.run "${HPC_LAUNCHER_ARGS[@]}" -m hpc_rlhf "${HPC_MODE_ARGS[@]}"
