#!/bin/bash
# requeue_guard.sh MARGIN_S [MAX_RESTARTS [WATCHED_PID]]: requeue this Slurm job MARGIN_S seconds before its time
# limit if it is still running then, whatever its ranks are doing. It ends with the process WATCHED_PID (the batch
# shell that started it) and once the job is no longer RUNNING: a job that has finished and is completing has an
# EndTime in the past, and must not be requeued.
#
# Started in the background by the batch shell (sbatch/common.sh's hpc_train, and the job script `hpc-rlhf
# submit` writes), beside the step. The normal stop is the ranks': Slurm's stop signal (--signal=USR1@LEAD) makes
# them finish their step, write a checkpoint and exit 75, and the batch shell requeues. When that takes longer
# than LEAD - MARGIN_S (a slow step, a slow file system, a rank that never answers), Slurm would kill the job at its
# limit and end it TIMEOUT, and no one would requeue it: this guard requeues it first. Slurm then ends the running
# job (the checkpoint being written is left unsealed, so it is never resumed from) and queues it again under the
# same id; the run resumes from its last complete checkpoint.
#
# It reads the job's EndTime from scontrol every REQUEUE_GUARD_POLL_S seconds (default 30, less near the end), so
# a time limit changed while the job runs (scontrol update) counts. It needs only bash, date and scontrol: it runs
# outside any container. Past MAX_RESTARTS (SLURM_RESTART_COUNT) it does not requeue.
set -u
margin=${1:?usage: requeue_guard.sh MARGIN_S [MAX_RESTARTS [WATCHED_PID]]}
max_restarts=${2:-20}
watched=${3:-}
poll=${REQUEUE_GUARD_POLL_S:-30}
job=${SLURM_JOB_ID:?requeue_guard.sh runs inside a Slurm job}
restarts=${SLURM_RESTART_COUNT:-0}
# No TERM trap: the batch shell's `kill` must end the guard at once, and bash 5.2 fails to run a trap that arrives
# while it parses a $(...) (the handler is refused as "unexpected EOF", the loop goes on, seen in a test run). With
# TERM's default action the guard ends wherever it is. It waits with a timed `read` on a pipe of its own that no
# one writes to, not with a `sleep` child, so that no child outlives it holding the job's output open.
exec {pause}<> <(:)
say() { echo "[$(date +%H:%M:%S) job $job restart $restarts] requeue guard: $*" >&2; }

while true; do
  if [ -n "$watched" ] && ! kill -0 "$watched" 2>/dev/null; then exit 0; fi
  fields=$(scontrol show job -o "$job" 2>/dev/null)
  state=$(sed -n 's/.* JobState=\([^ ]*\).*/\1/p' <<<"$fields")
  case "$state" in
    RUNNING|"") ;;  # "": scontrol did not answer this time (a busy controller): ask again
    PENDING|CONFIGURING) read -r -t 1 -u "$pause" _ || true; continue ;;
    *) exit 0 ;;  # completing, completed, requeued, cancelled: nothing left to guard
  esac
  end=$(sed -n 's/.* EndTime=\([^ ]*\).*/\1/p' <<<"$fields")
  end_s=
  # Only a date: `date -d ""` would read an empty field as today's midnight (EndTime=Unknown: no limit yet).
  [[ "$end" =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T ]] && end_s=$(date -d "$end" +%s 2>/dev/null)
  if [ -n "$end_s" ]; then
    left=$((end_s - $(date +%s)))
    if [ "$left" -le "$margin" ]; then
      if [ "$restarts" -ge "$max_restarts" ]; then
        say "the ranks still run ${left} s before the time limit, but the job has restarted $restarts times" \
            "(MAX_RESTARTS=$max_restarts): not requeueing"
        exit 0
      fi
      say "the ranks have not stopped ${left} s before the time limit (margin ${margin} s): requeueing job $job" \
          "now; it resumes from its last complete checkpoint"
      scontrol requeue "$job" || say "scontrol requeue failed: the job ends at its time limit"
      exit 0
    fi
    wait_s=$((left - margin < poll ? left - margin : poll))
  else
    wait_s=$poll
  fi
  read -r -t "$((wait_s > 1 ? wait_s : 1))" -u "$pause" _ || true
done
