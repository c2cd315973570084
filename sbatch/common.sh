# Shared logic of the sbatch scripts in this folder; they source it, it is not run on its own.
#
# Slurm runs a copy of the batch script from its spool folder, so the scripts find this file through
# HPC_RLHF_HOME (default: the folder `sbatch` was called from, SLURM_SUBMIT_DIR). Submit from the repository
# root, or export HPC_RLHF_HOME=/path/to/hpc_rlhf. Jobs run in the submit folder: relative paths in configs
# (examples/tiny/...) are read from there. The ranks start through launch/srun.sh, the entry point for srun
# (launch/env.sh: the python command and the ranks' defaults, shared with it).
#
# Settings every script understands (environment variables, exported before `sbatch` or set in the script):
#   MODE, CONFIG        the training mode and its YAML config (CONFIG= empty: the mode's defaults)
#   PLACEMENT           roles on ranks (ppo, grpo), e.g. actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2;
#                       unset: the config's `placement`, so the layout a dry run of the YAML checked is the one
#                       that runs; set: passed to the mode as placement=... (the check reads it too);
#                       single-model modes (sft, kd, rm, prm, dpo, kto) use actor=<all ranks>
#   PYTHON              the interpreter with hpc_rlhf installed (default: python on PATH), e.g. a virtual
#                       environment on the cluster's shared file system: PYTHON=/shared/venvs/hpc_rlhf/bin/python
#   PLAN_MODEL          model shape for the check of roles whose model folder is a placeholder (7b, 70b, ...)
#   GPU_MEMORY_GB       memory of one GPU for the check (default 80)
#   HOST_MEMORY_GB      memory of one node for the check (offloaded optimizer states, the ranks' processes);
#                       default: the job's --mem (SLURM_MEM_PER_NODE) when it is > 0, else (--mem=0 or no --mem)
#                       the smallest RealMemory of the job's nodes (scontrol show node); not checked when
#                       scontrol cannot say
#   CONTAINER           an Apptainer image (.sif): every rank runs `apptainer exec --nv $CONTAINER python ...`;
#                       binds come from APPTAINER_BIND (e.g. APPTAINER_BIND=/scratch,/datasets)
#   MAX_RESTARTS        requeue a preempted job at most this many times (default 20)
#   STOP_LEAD_S         the script's #SBATCH --signal=USR1@LEAD, in seconds (default 600): the time the ranks have
#                       for their last step and checkpoint; the check warns when the checkpoint alone needs more
#   REQUEUE_MARGIN_S    requeue the job this many seconds before its time limit if the ranks still run then
#                       (hpc_rlhf/launch/requeue_guard.sh; default 120): a slow stop still requeues
#   CHECKPOINT_GBPS     the write speed of one node to output_dir's file system, GB/s, for that warning (default 2)
#   CHECK_FILES         1 (default): the check reads the real files too (model and tokenizer folders, the first rows
#                       of the data files, output_dir writable with room for the checkpoints kept, final/ and best/); 0: the plan only
#   MASTER_ADDR/PORT    rendezvous; default: first host of the allocation, port 10000 + job id % 20000 (below
#                       Linux's ephemeral ports, 32768-60999; the same formula as hpc_rlhf.dist.launch_env)
#   NCCL_*              passed to every rank unchanged when set (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...);
#                       when unset NCCL picks its own defaults

source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"

HPC_PREEMPTED_EXIT_CODE=75  # hpc_rlhf.runtime.checkpointing.Preempted: checkpoint written, run me again
HPC_ROLE_MODES=" ppo grpo "  # modes whose roles are placed on ranks; the others are one data-parallel group

hpc_is_role_mode() { [[ "$HPC_ROLE_MODES" == *" $MODE "* ]]; }

hpc_log() { echo "[$(date +%T) job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}] $*"; }
hpc_die() { hpc_log "ERROR: $*" >&2; exit 2; }

# Ranks per node, from SLURM_TASKS_PER_NODE ("4(x2)" or "4,4"): the plan needs nodes of equal size.
hpc_ranks_per_node() {
  local first=${SLURM_TASKS_PER_NODE%%,*}
  echo "${first%%(*}"
}

# Environment of the job: rendezvous, threads, the python command (local or in the container).
hpc_setup() {
  [ -n "${SLURM_JOB_ID:-}" ] || hpc_die "run this script with sbatch (SLURM_JOB_ID is not set)"
  MODE=${MODE:?MODE must be set (sft, kd, rm, prm, dpo, kto, ppo, grpo)}
  CONFIG=${CONFIG-}
  PLACEMENT=${PLACEMENT:-}
  hpc_is_role_mode || PLACEMENT=${PLACEMENT:-actor=$SLURM_NTASKS}
  if [ -n "$CONFIG" ] && [ ! -f "$CONFIG" ]; then
    hpc_die "CONFIG=$CONFIG does not exist (relative to $(pwd)); set CONFIG to your YAML file"
  fi
  # hpc_rlhf's bootstrap derives the same values; exporting them lets other tools (and NCCL's logs) see them.
  export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  export MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
  # srun of Slurm 22.05-23.02 no longer takes --cpus-per-task from the job (SLURM_CPUS_PER_TASK): without this
  # each rank of the step would get one CPU while OMP_NUM_THREADS says more.
  [ -z "${SLURM_CPUS_PER_TASK:-}" ] || export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
  hpc_rank_env
  hpc_store_secret  # made once here, so that every step of the job (and each requeue) has its own
  # launch/srun.sh, a process of its own, reads them too.
  export PYTHON CONTAINER
  hpc_python || hpc_die "the ranks' python command cannot run here (see the line above)"
  hpc_log "mode=$MODE config=${CONFIG:-<defaults>} placement=${PLACEMENT:-<from the config>}" \
          "nodes=$SLURM_JOB_NODELIST tasks=$SLURM_NTASKS" \
          "(per node $(hpc_ranks_per_node)) master=$MASTER_ADDR:$MASTER_PORT python=${HPC_PYTHON[*]}"
  local nccl
  nccl=$(env | grep -E '^NCCL_' | sort | tr '\n' ' ')
  [ -z "$nccl" ] || hpc_log "NCCL settings: $nccl"
}

# The mode's arguments, the same for the check and for the ranks: MODE, the config, PLACEMENT when set (role
# modes; unset, the config's own) or the world size (one-model modes), then the script's key=value arguments.
# Usage: hpc_mode_args [key=value ...]  -> array HPC_MODE_ARGS
hpc_mode_args() {
  HPC_MODE_ARGS=("$MODE")
  [ -z "$CONFIG" ] || HPC_MODE_ARGS+=(--config "$CONFIG")
  if ! hpc_is_role_mode; then HPC_MODE_ARGS+=("dist.nproc=$SLURM_NTASKS")
  elif [ -n "$PLACEMENT" ]; then HPC_MODE_ARGS+=("placement=$PLACEMENT"); fi
  HPC_MODE_ARGS+=("$@")
}

# Check the config against this allocation before any rank starts: `hpc-rlhf MODE ... --dry-run` reads what the
# ranks will read (the config, the placement, the script's arguments) and exits 2, naming the key, when the job
# would not start: roles that do not add up to the world, an engine across two nodes, a role the config needs
# and the placement lacks, batch sizes that do not divide the role groups, a rank that needs more GPU memory than
# GPU_MEMORY_GB (default 80), a node short of host memory, and (CHECK_FILES=1, the default) a model or tokenizer
# folder, data file or output_dir that is not what the run needs (hpc_rlhf/launch/preflight.py). So the job ends in
# seconds, not after every rank has loaded a model. The plan and the memory per GPU go into the job log. PLAN_MODEL
# (a preset such as 7b or 70b, or a config.json) gives the shape of the models whose folders are not there yet
# (placeholders; with CHECK_FILES=0 only). Usage: hpc_check_plan [key=value ...]
hpc_check_plan() {
  hpc_mode_args "$@"
  local model=() host
  [ -z "${PLAN_MODEL:-}" ] || model=(--model "$PLAN_MODEL")
  [ "${CHECK_FILES:-1}" = 0 ] || model+=(--check-files)
  host=$(hpc_host_memory_gb)  # empty: not known, and hpc_host_memory_gb said why on stderr
  [ -z "$host" ] || model+=(--host-memory-gb "$host")
  "${HPC_PYTHON[@]}" -m hpc_rlhf "${HPC_MODE_ARGS[@]}" --dry-run --world-size "$SLURM_NTASKS" \
    --gpus-per-node "$(hpc_ranks_per_node)" --gpu-memory-gb "${GPU_MEMORY_GB:-80}" "${model[@]}" \
    --stop-lead-s "${STOP_LEAD_S:-600}" --requeue-margin-s "${REQUEUE_MARGIN_S:-120}" \
    --checkpoint-gbps "${CHECKPOINT_GBPS:-2}" \
    || hpc_die "the config does not start on this allocation ($SLURM_NTASKS ranks, $(hpc_ranks_per_node) per" \
               "node; placement '${PLACEMENT:-from the config}'): see the line above; not starting"
}

# The memory of one node for the check, in GB (1e9 bytes): HOST_MEMORY_GB, else the job's --mem
# (SLURM_MEM_PER_NODE, MiB) when it is > 0, else the smallest RealMemory of the job's nodes: RealMemory is the
# memory Slurm hands out on a node, all of which a job with --mem=0 (ppo_70b) gets, and the nodes of one job may
# differ. Prints nothing, and one line on stderr, when none of them is known.
hpc_host_memory_gb() {
  local mib
  if [ -n "${HOST_MEMORY_GB:-}" ]; then echo "$HOST_MEMORY_GB"; return 0; fi
  if [ "${SLURM_MEM_PER_NODE:-0}" -gt 0 ] 2>/dev/null; then mib=$SLURM_MEM_PER_NODE
  else mib=$(hpc_nodes_real_memory_mib) || return 0; fi
  awk -v mib="$mib" 'BEGIN { printf "%.1f", mib * 1.048576 / 1000 }'
}

# The smallest RealMemory (MiB, what `scontrol show node` reports) over the job's nodes; fails, with one line on
# stderr, when scontrol is missing or one node's record has no RealMemory, or one under 1 GiB: Slurm's default for a
# node whose memory the administrator did not configure is 1 MiB, which would refuse every job.
hpc_nodes_real_memory_mib() {
  local unknown="host memory not checked: set HOST_MEMORY_GB (GB per node) or #SBATCH --mem;"
  if ! command -v scontrol >/dev/null; then
    hpc_log "$unknown scontrol is not on PATH to read the nodes' RealMemory" >&2; return 1
  fi
  local records node mem smallest=""
  # One request for all the job's nodes ("NAME MIB" a line): one per node would be hundreds for slurmctld to answer
  # at the start of a large job. `scontrol show hostnames` expands the list without asking it.
  records=$(scontrol show node "$SLURM_JOB_NODELIST" 2>/dev/null | awk '{ for (i = 1; i <= NF; i++) {
    if ($i ~ /^NodeName=/) name = substr($i, 10); if ($i ~ /^RealMemory=/) print name, substr($i, 12) } }')
  for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null); do
    mem=$(awk -v node="$node" '$1 == node { print $2; exit }' <<< "$records")
    if ! [ "${mem:-0}" -gt 0 ] 2>/dev/null; then
      hpc_log "$unknown 'scontrol show node $SLURM_JOB_NODELIST' gave no RealMemory for $node" >&2; return 1
    fi
    if [ "$mem" -lt 1024 ]; then
      hpc_log "$unknown node $node has RealMemory=$mem MiB (not configured in slurm.conf?)" >&2; return 1
    fi
    if [ -z "$smallest" ] || [ "$mem" -lt "$smallest" ]; then smallest=$mem; fi
  done
  if [ -z "$smallest" ]; then
    hpc_log "$unknown 'scontrol show hostnames $SLURM_JOB_NODELIST' named no node" >&2; return 1
  fi
  echo "$smallest"
}

# An all-reduce across every task (`hpc-rlhf bandwidth`: NCCL on GPUs, gloo on CPUs), its time and bandwidth
# printed by rank 0. Usage: hpc_bandwidth [--size-mb MB] [--iters N]
hpc_bandwidth() {
  "$HPC_RLHF_HOME/launch/srun.sh" bandwidth "$@" \
    || hpc_die "the all-reduce across the job's $SLURM_NTASKS ranks failed (see above): the fabric or NCCL's settings"
}

# Run the mode on every task, then requeue the job if it was preempted. Usage: hpc_train [key=value ...]
#
# Why the script requeues: `#SBATCH --requeue` only lets Slurm requeue a job after a node failure or a
# preemption it performs itself. A job that reaches its time limit simply ends (TIMEOUT). Our ranks checkpoint
# on the early SIGUSR1 (#SBATCH --signal) and exit with code 75; the script then calls `scontrol requeue`, and
# the job runs again under the same id, appending to the same log (--open-mode=append), and resumes from the
# newest checkpoint in output_dir. A stop that overruns (a step or a checkpoint slower than the signal's lead, a
# rank that never answers) would end the job at its limit, TIMEOUT, with no one to requeue it: the requeue guard
# (hpc_rlhf/launch/requeue_guard.sh) requeues it REQUEUE_MARGIN_S before the limit whatever the ranks do.
hpc_train() {
  # The arguments that were checked are the ones the ranks get (hpc_mode_args).
  hpc_mode_args "$@"
  local args=("${HPC_MODE_ARGS[@]}")
  # When Slurm preempts the job it sends SIGTERM to the batch shell too; the shell must outlive srun so that
  # the ranks can finish their checkpoint, so it only notes the signal.
  local signalled=0
  trap 'signalled=1; hpc_log "SIGTERM: job preempted or cancelled; ranks are checkpointing"' TERM
  # launch/srun.sh execs `srun --kill-on-bad-exit=1 ... python -m hpc_rlhf.launch.slurm rank MODE ...`: one
  # failed rank ends the step at once, instead of the others waiting in a collective until its timeout. Ranks that
  # are already stopping for a checkpoint ignore that SIGTERM and finish.
  "$HPC_RLHF_HOME/launch/srun.sh" "${args[@]}" &
  local pid=$! rc guard
  bash "$HPC_RLHF_HOME/hpc_rlhf/launch/requeue_guard.sh" "${REQUEUE_MARGIN_S:-120}" "${MAX_RESTARTS:-20}" $$ &
  guard=$!
  wait "$pid"; rc=$?
  while [ "$signalled" = 1 ]; do signalled=0; wait "$pid"; rc=$?; done
  kill "$guard" 2>/dev/null
  trap - TERM
  if [ "$rc" = "$HPC_PREEMPTED_EXIT_CODE" ]; then
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [ "$restarts" -ge "${MAX_RESTARTS:-20}" ]; then
      hpc_log "preempted after $restarts restarts (MAX_RESTARTS=${MAX_RESTARTS:-20}); not requeueing"
      return "$rc"
    fi
    hpc_log "ranks checkpointed and stopped (exit $rc); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" \
      || hpc_log "scontrol requeue failed (already requeued by Slurm?); if the job ends, resubmit it to continue"
    return "$rc"
  fi
  hpc_log "training step ended with exit code $rc"
  return "$rc"
}
