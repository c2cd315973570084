# Sourced by the launch scripts in this folder and by sbatch/common.sh; it is not an entry point of its own.
#
# Sets HPC_RLHF_HOME to the checkout this folder belongs to (unless set) and defines:
#   hpc_python        the python command every rank runs, in the array HPC_PYTHON, from
#                       PYTHON     an interpreter with hpc_rlhf installed (default: python on PATH; may carry
#                                  flags, e.g. PYTHON="python3 -X faulthandler")
#                       CONTAINER  an Apptainer image (.sif): `apptainer exec --nv $CONTAINER python`; binds come
#                                  from APPTAINER_BIND (e.g. APPTAINER_BIND=/scratch,/datasets)
#                     returns 2, after saying why on stderr, when CONTAINER cannot be used
#   hpc_rank_env      defaults the ranks need: one OpenMP thread per CPU Slurm gave the task (else 1),
#                     unbuffered output (ranks' lines arrive whole and in time), no tokenizer thread pools, and
#                     Hugging Face offline (compute nodes have no internet: a hub lookup would hang until its
#                     timeout; the image sets the same; HF_HUB_OFFLINE=0 where a node may reach the hub)
#   hpc_store_secret  HPC_RLHF_STORE_SECRET, the job's rendezvous-store secret (docs/failures.md, "Who can steer a
#                     job"), unless set: from the kernel's random source, exported to the ranks this shell starts,
#                     never on a command line (other users can read those) or in a file
#   hpc_split_args    "LAUNCHER_OPTION ... -- MODE ARG ..." -> arrays HPC_LAUNCHER_ARGS and HPC_MODE_ARGS
#                     (without `--`, every argument is the mode's)
#   hpc_need_mode     exit 2 with the given usage line when no mode was given

HPC_RLHF_HOME=${HPC_RLHF_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

hpc_python() {
  if [ -n "${CONTAINER:-}" ]; then
    if [ ! -f "$CONTAINER" ]; then
      echo "CONTAINER=$CONTAINER is not a file (build it: see containers/README.md)" >&2
      return 2
    fi
    if ! command -v apptainer >/dev/null; then
      echo "CONTAINER is set but apptainer is not on PATH (module load apptainer?)" >&2
      return 2
    fi
    # --nv maps the host's NVIDIA driver and GPUs into the container.
    HPC_PYTHON=(apptainer exec --nv "$CONTAINER" python)
  else
    # shellcheck disable=SC2206  # word splitting wanted: PYTHON may carry flags
    HPC_PYTHON=(${PYTHON:-python})
  fi
}

hpc_rank_env() {
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
}

hpc_store_secret() {
  if [ -z "${HPC_RLHF_STORE_SECRET:-}" ]; then
    HPC_RLHF_STORE_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  fi
  export HPC_RLHF_STORE_SECRET
}

hpc_split_args() {
  HPC_LAUNCHER_ARGS=()
  HPC_MODE_ARGS=("$@")
  local i
  for ((i = 1; i <= $#; i++)); do
    if [ "${!i}" = "--" ]; then
      HPC_LAUNCHER_ARGS=("${@:1:i-1}")
      HPC_MODE_ARGS=("${@:i+1}")
      return 0
    fi
  done
}

hpc_need_mode() {
  if [ "${#HPC_MODE_ARGS[@]}" -eq 0 ]; then
    echo "usage: $1" >&2
    echo "(see the comment at the top of $(basename "$0") for what it needs and examples)" >&2
    exit 2
  fi
}
