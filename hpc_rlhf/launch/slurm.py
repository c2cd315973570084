"""Submit a training mode to Slurm from Python (submitit), and requeue a preempted job.

    job = submit("sft", "examples/tiny/sft.yaml", ["train.max_steps=50"], nodes=2, tasks_per_node=2)
    job.results()          # one entry per task, when the job is done

or from a shell (the same arguments; everything after `--` is a key=value override of the mode), through the
entry point users run, launch/submit.py (or `hpc-rlhf submit`, or `python -m hpc_rlhf.launch.slurm`)::

    python launch/submit.py sft --config examples/tiny/sft.yaml --nodes 2 --tasks-per-node 2 \
        --wait -- train.max_steps=50

Inside an srun step, `python -m hpc_rlhf.launch.slurm rank MODE ...` runs one rank (`run_rank`): what
launch/srun.sh, and so the sbatch scripts, start on every task.

Each Slurm task runs `hpc_rlhf.launch.modes.run([mode, ...])` in submitit's process; our bootstrap recognises the
srun step from its SLURM_* variables, so submitit jobs form the same world as sbatch jobs.

Preemption and walltime. Slurm sends SIGUSR1 `signal_delay_s` seconds before the time limit (and SIGTERM on
preemption); the trainers stop every rank after the same step, write a checkpoint and exit with code 75
(`Preempted`). The task then asks Slurm to requeue the job (`requeue_self`, rank 0 only) and exits without a
result, so submitit keeps waiting; the requeued job runs the same task again and the trainer resumes from the
newest checkpoint in its output_dir. The task holds no state of its own: `checkpoint()` (called by submitit's
own signal handler, which is in charge until the trainer has installed its handlers) resubmits it unchanged. A stop
that overruns (the ranks still running `requeue_margin_s` before the limit) is requeued by the requeue guard the job
script starts (requeue_guard.sh, as in the sbatch scripts), so the job never ends TIMEOUT with no one to requeue it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Sequence

import submitit

from hpc_rlhf.dist.store_guard import SECRET_VAR
from hpc_rlhf.launch import modes

PREEMPTED_EXIT_CODE = 75  # hpc_rlhf.runtime.checkpointing.Preempted.EXIT_CODE (not imported: that pulls in torch)
STOP_SIGNAL = "USR1"  # what runtime.checkpointing.StopSignal handles (besides SIGTERM)
# Slurm needs this much time after the stop signal for the last step, the checkpoint and the exit.
MIN_SECONDS_AFTER_SIGNAL = 60
# Requeues the job this many seconds before its limit if the ranks have not stopped by then (at most half the
# signal's lead by default): the same guard as the sbatch scripts' (sbatch/common.sh).
REQUEUE_GUARD = Path(__file__).with_name("requeue_guard.sh")
DEFAULT_REQUEUE_MARGIN_S = 120


class SlurmLaunchError(RuntimeError):
    """A submission that cannot work (bad arguments, not inside a Slurm job); the message says why."""


# -------------------------------------------------------------------------------------------------- requeue
def requeue_self(job_id: str | None = None, *, env: Mapping[str, str] | None = None) -> str:
    """`scontrol requeue` this job (SLURM_JOB_ID, or `job_id`); returns the job id that was requeued.

    Slurm then ends the running job and queues it again under the same id, with SLURM_RESTART_COUNT + 1.
    Raises SlurmLaunchError outside a Slurm job or when scontrol refuses (its message is included).
    """
    env = os.environ if env is None else env
    # SLURM_JOB_ID is unique also for each element of a job array, so it names exactly this job.
    job_id = job_id or env.get("SLURM_JOB_ID")
    if not job_id:
        raise SlurmLaunchError("requeue_self: SLURM_JOB_ID is not set, so this process is not inside a Slurm job")
    try:
        proc = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmLaunchError("requeue_self: scontrol is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmLaunchError(f"requeue_self: scontrol requeue {job_id} did not answer within 60 s") from None
    if proc.returncode != 0:
        reason = " ".join((proc.stderr or proc.stdout or "").split())
        raise SlurmLaunchError(f"requeue_self: scontrol requeue {job_id} failed (exit {proc.returncode}): {reason}")
    return str(job_id)


def should_requeue(exit_code: int, restart_count: int, max_restarts: int) -> bool:
    """True when a step that ended with `exit_code` should be requeued (a checkpoint was written for it)."""
    return exit_code == PREEMPTED_EXIT_CODE and restart_count < max_restarts


# ------------------------------------------------------------------------------------------------ one rank
def run_rank(argv: Sequence[str]) -> int:
    """Run `hpc-rlhf ARGV...` as one rank of a Slurm step and return its exit code (75 after a preemption).

    A preempted rank has written its checkpoint and is only exiting, but two signals can still reach it while
    Python shuts down, when Python has put their default action (terminate) back: `srun --kill-on-bad-exit=1`
    answers the first rank that exits 75 by sending SIGTERM to the others, and the stop signal itself (SIGUSR1)
    can arrive late on one node: on a loaded machine one node's slurmd delivered it after the ranks had agreed
    to stop on the word of the ranks that got it in time. A rank killed by either makes srun report 143 or 138
    instead of 75, and the batch script would not requeue. A preempted rank therefore ignores both from here on
    (Python leaves an ignored signal ignored at shutdown).
    """
    try:
        code = modes.run(list(argv))
    except SystemExit as exc:  # Preempted is a SystemExit(75); argparse exits with 2
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code == PREEMPTED_EXIT_CODE:
        for late in (signal.SIGTERM, getattr(signal, f"SIG{STOP_SIGNAL}")):
            signal.signal(late, signal.SIG_IGN)
    return code


# --------------------------------------------------------------------------------------------- the job task
def _global_rank(env: Mapping[str, str]) -> int:
    return int(env.get("SLURM_PROCID", env.get("RANK", "0")))


# The rank variables of another launcher's world: torchrun's, the local launcher's, or those hpc_rlhf's bootstrap
# exports for torch's env:// rendezvous in any process that ran a mode.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                   "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "HPC_RLHF_LOCAL_LAUNCH", "HPC_RLHF_ERROR_FILE")


def forget_the_submitters_world(env: MutableMapping[str, str]) -> list[str]:
    """Remove from a submitit task's environment the world of the process that submitted it; return what went.

    sbatch gives the job the submitting process's environment, and srun starts the task directly, so any RANK or
    WORLD_SIZE in it belongs to the submitter (a notebook that ran a mode, a torchrun job that submits the next
    stage): left there, the bootstrap would take the task for a torchrun rank of that world (it reads them before
    Slurm's variables). With them go that world's MASTER_ADDR and MASTER_PORT; set in a submitting process that
    had no world of its own, those are the user's choice of address and port (they override the node list's) and
    stay."""
    gone = [name for name in WORLD_VARIABLES if name in env]
    if "RANK" in gone or "WORLD_SIZE" in gone:
        gone += [name for name in ("MASTER_ADDR", "MASTER_PORT") if name in env]
    for name in gone:
        del env[name]
    return gone


class TrainingTask(submitit.helpers.Checkpointable):
    """Runs `hpc-rlhf MODE ARGS...` on one Slurm task; requeues the job when the mode was preempted."""

    def __init__(self, mode: str, args: Sequence[str], max_restarts: int = 100):
        self.mode = mode
        self.args = list(args)
        self.max_restarts = max_restarts

    def __call__(self) -> dict[str, Any]:
        forget_the_submitters_world(os.environ)
        code = run_rank([self.mode, *self.args])
        rank = _global_rank(os.environ)
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if code == PREEMPTED_EXIT_CODE:
            if not should_requeue(code, restarts, self.max_restarts):
                raise RuntimeError(f"hpc-rlhf {self.mode} was preempted again after {restarts} restarts "
                                   f"(max_restarts={self.max_restarts}); not requeueing")
            if rank == 0:
                try:
                    print(f"hpc-rlhf {self.mode}: checkpoint written, requeueing job {requeue_self()} "
                          f"(restart {restarts + 1})", file=sys.stderr, flush=True)
                except SlurmLaunchError as exc:
                    # Slurm may be requeueing the job itself (preemption with PreemptMode=REQUEUE). If not, the
                    # job ends without a result and the checkpoint waits for a resubmission.
                    print(f"hpc-rlhf {self.mode}: checkpoint written; {exc}", file=sys.stderr, flush=True)
            # No return value: submitit would record the job as finished. Slurm ends this run and starts the
            # requeued one, which resumes from the checkpoint.
            raise SystemExit(code)
        if code != 0:
            raise RuntimeError(f"hpc-rlhf {self.mode} failed on rank {rank} with exit code {code}; its output is "
                               f"in this job's submitit log")
        return {"rank": rank, "exit_code": 0, "restarts": restarts}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        # The training state is in output_dir (the trainers resume from it), so the task resubmits unchanged.
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# ----------------------------------------------------------------------------------------------- submission
def slurm_parameters(*, nodes: int = 1, tasks_per_node: int = 1, gpus_per_node: int = 0, cpus_per_task: int = 1,
                     time_min: int = 60, partition: str | None = None, account: str | None = None,
                     signal_delay_s: int = 60, job_name: str = "hpc_rlhf",
                     extra_slurm: Mapping[str, Any] | None = None, requeue_margin_s: int | None = None,
                     max_restarts: int = 100) -> dict[str, Any]:
    """Our arguments as `submitit.SlurmExecutor.update_parameters` keywords (checked, no cluster needed).

    The job script starts the requeue guard (requeue_guard.sh, its text inlined: the job's shell may not see this
    installation) in the background before the tasks: `requeue_margin_s` (default: 120 s, at most half of
    `signal_delay_s`) before the limit it requeues a job whose ranks have not stopped."""
    for name, value, minimum in (("nodes", nodes, 1), ("tasks_per_node", tasks_per_node, 1),
                                 ("gpus_per_node", gpus_per_node, 0), ("cpus_per_task", cpus_per_task, 1),
                                 ("time_min", time_min, 1), ("signal_delay_s", signal_delay_s, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise SlurmLaunchError(f"submit: {name} must be an integer of at least {minimum}, got {value!r}")
    if requeue_margin_s is None:
        requeue_margin_s = min(DEFAULT_REQUEUE_MARGIN_S, signal_delay_s // 2)
    if not isinstance(requeue_margin_s, int) or isinstance(requeue_margin_s, bool) or \
            not 0 <= requeue_margin_s < signal_delay_s:
        raise SlurmLaunchError(f"submit: requeue_margin_s must be a whole number of seconds from 0 to less than "
                               f"signal_delay_s ({signal_delay_s} s), got {requeue_margin_s!r}: the guard would "
                               f"requeue the job before its ranks could stop")
    if time_min * 60 < signal_delay_s + MIN_SECONDS_AFTER_SIGNAL:
        raise SlurmLaunchError(f"submit: time_min={time_min} leaves no room for the stop signal: the time limit "
                               f"must exceed signal_delay_s ({signal_delay_s} s) by at least "
                               f"{MIN_SECONDS_AFTER_SIGNAL} s, or the job ends before it can checkpoint")
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": cpus_per_task,
        "time": time_min,
        "signal_delay_s": signal_delay_s,
        # submitit would ask for its own USR2; our trainers checkpoint on USR1 (and SIGTERM). Inside the job,
        # submitit's handler uses the same signal until the trainer takes it over.
        "setup": [f"export SUBMITIT_PREEMPT_SIGNAL={STOP_SIGNAL}",
                  # Made in the job, not here: the script is a file other users may read (store_guard).
                  f"[ -n \"${{{SECRET_VAR}:-}}\" ] || export {SECRET_VAR}=$(od -An -N32 -tx1 /dev/urandom | "
                  "tr -d ' \\n')",
                  f"bash -c {shlex.quote(REQUEUE_GUARD.read_text())} requeue_guard {requeue_margin_s} "
                  f"{max_restarts} $$ &"],
        "additional_parameters": {"signal": f"{STOP_SIGNAL}@{signal_delay_s}", "requeue": True},
    }
    if gpus_per_node:  # `--gpus-per-node=0` is refused by clusters without GPU resources
        params["gpus_per_node"] = gpus_per_node
    if partition:
        params["partition"] = partition
    if account:
        params["account"] = account
    for key, value in (extra_slurm or {}).items():
        # Plain sbatch options (e.g. {"qos": "high", "constraint": "a100"}) win over ours.
        params["additional_parameters"][str(key).replace("_", "-")] = value
    return params


def task_args(config: str | None, overrides: Sequence[str], world_size: int) -> list[str]:
    """The mode's command-line arguments: config, overrides and, unless given, the world size to expect."""
    args = ["--config", str(config)] if config else []
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        raise SlurmLaunchError(f"submit: override {bad[0]!r} is not key=value")
    args += list(overrides)
    # Single-model modes check the world against dist.nproc; placement modes ignore it.
    if not any(o.startswith("dist.nproc=") for o in overrides):
        args.append(f"dist.nproc={world_size}")
    return args


def container_python(container: str | None) -> str | None:
    """The python command of the job: inside `apptainer exec --nv IMAGE` when a container is given."""
    if not container:
        return None
    return f"apptainer exec --nv {shlex.quote(str(container))} python"


def submit(mode: str, config: str | None = None, overrides: Sequence[str] = (), nodes: int = 1,
           tasks_per_node: int = 1, gpus_per_node: int = 0, cpus_per_task: int = 1, time_min: int = 60,
           partition: str | None = None, account: str | None = None, folder: str | os.PathLike = "runs/submitit",
           signal_delay_s: int = 60, container: str | None = None,
           extra_slurm: Mapping[str, Any] | None = None, requeue_margin_s: int | None = None) -> submitit.Job:
    """Queue `hpc-rlhf MODE` on nodes x tasks_per_node Slurm tasks; returns the submitit Job.

    `folder` receives submitit's pickles and logs (one subfolder per job id; it must be on a file system the
    nodes share). The job runs in the current directory, so relative config paths work as they do here.
    """
    if mode not in modes.TRAINING_MODES:
        kind = "a command, not a training mode" if mode in modes.COMMANDS else "not a mode"
        raise SlurmLaunchError(f"submit: '{mode}' is {kind}; choose one of {', '.join(modes.TRAINING_MODES)}")
    if config is not None and not Path(config).is_file():
        raise SlurmLaunchError(f"submit: config file {config} does not exist")
    params = slurm_parameters(nodes=nodes, tasks_per_node=tasks_per_node, gpus_per_node=gpus_per_node,
                              cpus_per_task=cpus_per_task, time_min=time_min, partition=partition, account=account,
                              signal_delay_s=signal_delay_s, job_name=f"hpc_rlhf-{mode}", extra_slurm=extra_slurm,
                              requeue_margin_s=requeue_margin_s)
    task = TrainingTask(mode, task_args(config, overrides, nodes * tasks_per_node))
    executor = submitit.SlurmExecutor(folder=Path(folder) / "%j", python=container_python(container))
    executor.update_parameters(**params)
    return executor.submit(task)


# ---------------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "python -m hpc_rlhf.launch.slurm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Queue an hpc-rlhf training mode on Slurm with submitit (requeued on preemption).",
        epilog=f"example: {prog} sft --config examples/tiny/sft.yaml --nodes 2 --tasks-per-node 2 --wait -- "
               f"train.max_steps=50")
    parser.add_argument("mode", help="training mode (sft, kd, rm, prm, dpo, kto, ppo, grpo, ...)")
    parser.add_argument("--config", "-c", default=None, help="YAML config of the mode")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node (one per GPU)")
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--cpus-per-task", type=int, default=1)
    parser.add_argument("--time-min", type=int, default=60, help="time limit of one run, in minutes")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--folder", default="runs/submitit", help="submitit pickles and logs (shared file system)")
    parser.add_argument("--signal-delay-s", type=int, default=60,
                        help="SIGUSR1 this many seconds before the time limit: checkpoint and requeue")
    parser.add_argument("--requeue-margin-s", type=int, default=None,
                        help="requeue the job this many seconds before the time limit if its ranks still run "
                             f"(default {DEFAULT_REQUEUE_MARGIN_S}, at most half of --signal-delay-s)")
    parser.add_argument("--container", default=None, help="Apptainer image (.sif) to run in, with --nv")
    parser.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                        help="extra sbatch option, e.g. --slurm qos=high (repeatable)")
    parser.add_argument("--wait", action="store_true", help="wait for the job and exit with its outcome")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m hpc_rlhf.launch.slurm") -> int:
    """The command line: a submission (launch/submit.py, `hpc-rlhf submit`), or one rank (`rank MODE ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:  # inside an srun step (see sbatch/common.sh): one rank, not a submission
        return run_rank(argv[1:])
    own, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser(prog)
    try:
        args = parser.parse_args(own)
    except SystemExit as exc:
        return int(exc.code or 0)
    extra = {}
    for item in args.slurm:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"{parser.prog}: --slurm {item!r} is not KEY=VALUE", file=sys.stderr)
            return 2
        extra[key] = value
    try:
        job = submit(args.mode, args.config, overrides, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                     gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time_min=args.time_min,
                     partition=args.partition, account=args.account, folder=args.folder,
                     signal_delay_s=args.signal_delay_s, container=args.container, extra_slurm=extra,
                     requeue_margin_s=args.requeue_margin_s)
    except SlurmLaunchError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    print(f"submitted job {job.job_id} ({args.mode}); logs in {Path(args.folder) / str(job.job_id)}", flush=True)
    if not args.wait:
        return 0
    try:
        results = job.results()
    except Exception as exc:  # noqa: BLE001 - submitit re-raises the task's failure; show it as one message
        print(f"job {job.job_id} failed: {exc}", file=sys.stderr)
        return 1
    print(f"job {job.job_id} finished: {len(results)} task(s), restarts {max(r['restarts'] for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
