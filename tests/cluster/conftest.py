"""The local Slurm cluster (scripts/local_slurm.sh) and the jobs the cluster tests check.

`cluster` uses a running local cluster, or brings one up once per session when this machine can host it (root
on Debian) and stops it again at the end (KEEP_LOCAL_SLURM=1 keeps it). Only when neither is possible are the
tests skipped, with the reason the script gives.

All of it starts in the background as soon as the session has collected a cluster test (tests/conftest.py,
tests/background.py): the cluster comes up at once, every job is submitted once the SFT base is trained (the
session's longest chain starts with it), and the cluster tests, ordered last, find their jobs finished. `tiny_jobs` submits every job
of the cluster tests at once, so that they share the machine's cores instead of waiting for each other: the
built-in tiny SFT (2 nodes x 1 task, the reference), the same job preempted mid-run, the tiny job under `mpirun`
and under `srun --mpi=pmix` (through launch/mpirun.sh and launch/srun.sh), and a submitit submission (also
preempted). Background threads send the preemption signals as soon as those jobs have logged a step. `lost_rank_jobs` (PPO jobs that each lose a rank)
is submitted with them, or alone when only its tests run. `gpu_script_jobs` (every GPU sbatch script shrunk to
the tiny model, ppo_70b's preempted) goes in after them.

The jobs' ranks run `python -m ...` through PYTHON=tests/zygote_python.py: forked from one pre-imported interpreter
of the session instead of importing torch each (the cluster tests alone, 2026-11-28: 847 -> ~475 busy CPU-s);
the MPI jobs' ranks and submitit's stay fresh interpreters, as does everything with
HPC_RLHF_TEST_FRESH_INTERPRETERS=1.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from tests import background
from tests.distributed import FRESH_VAR, REPO, Zygote, worker_env
from tests.zygote_python import SOCKET_VAR

SCRIPT = REPO / "scripts" / "local_slurm.sh"
# Long enough that the preemption signal lands mid-run (30 steps took 3.4 s of a loaded machine, and the signal came
# after them), short enough for a minute-long job.
STEPS = 50
STATE_POLL_S = 2.0
MPI_STEPS = 4  # the MPI jobs only have to start and train across their ranks: a few steps and the final eval
JOB_TIMEOUT_S = 600
QUEUE_WAIT_S = 1800  # the longest a job of the session may wait in the queue for its turn
# Printed by each rank before training: how our bootstrap sees the launch (no torch import). One write(2) of the
# whole line: print() under PYTHONUNBUFFERED writes word by word, and two ranks' words once interleaved in the
# output mpirun gathers ("PROBEPROBE mpi 0 2 / mpi 1 2").
PROBE = ("import os; from hpc_rlhf.dist.bootstrap import detect_launch; i = detect_launch(); "
         "os.write(1, f'PROBE {i.launcher} {i.rank} {i.world_size}\\n'.encode())")


# Task slots per fake node of the cluster the session brings up. The session's jobs (13, of 2 to 4 ranks) all went
# in at once with 8 (16 ranks running, load average 16 on 2 cores, 2026-11-26): the tests beside them ran 3-6x
# slower (a LoRA GRPO test 398 s against 64 s). With 4 a few jobs run at a time and the others wait in the queue.
SESSION_CPUS_PER_NODE = "4"


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CPUS_PER_NODE": os.environ.get("CPUS_PER_NODE",
                                                                             SESSION_CPUS_PER_NODE)})


@dataclass
class LocalCluster:
    """Submits and watches jobs of the local cluster, with the environment they need."""
    env: dict[str, str]

    def run(self, cmd: list[str], timeout: float = 60) -> str:
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit from the repository root (the sbatch scripts read examples/ and sbatch/ from there)."""
        proc = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"sbatch {' '.join(args)} failed: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (the record stays MinJobAge=3600 s after the end: the suite reads some jobs long after they ended)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id])
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Wait until the job has left the queue for good (a requeued job stays in it); return its record.

        `timeout` counts from when the job first runs: the session's jobs share 4 slots, and a job submitted with
        the others may wait its turn in the queue longer than it runs (never more than QUEUE_WAIT_S)."""
        submitted, started = time.monotonic(), None
        while True:
            state = self.job_fields(job_id).get("JobState", "")
            if state not in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "REQUEUE_HOLD",
                             "SUSPENDED"):
                return self.job_fields(job_id)
            if started is None and state != "PENDING":
                started = time.monotonic()
            now = time.monotonic()
            if (started is not None and now - started > timeout) or now - submitted > QUEUE_WAIT_S + timeout:
                break
            time.sleep(1)
        subprocess.run(["scancel", job_id], env=self.env)
        raise AssertionError(f"job {job_id} did not finish within {timeout:g} s of its start: "
                             f"{self.job_fields(job_id)}")


@dataclass
class ClusterState:
    cluster: LocalCluster | None
    started_here: bool = False
    skip_reason: str | None = None


def _bring_up() -> ClusterState:
    started_here = False
    if _script("status", timeout=60).returncode != 0:
        check = _script("check", timeout=60)
        if check.returncode != 0:
            return ClusterState(None, skip_reason="local Slurm cluster is not up and this machine cannot host it: "
                                                  f"{check.stdout.strip()}")
        up = _script("up", timeout=900)  # apt-get install the first time: a few minutes
        assert up.returncode == 0, f"scripts/local_slurm.sh up failed:\n{up.stdout}\n{up.stderr}"
        print(up.stdout, file=sys.stderr)
        started_here = True
    prefix = _status_prefix()
    env = worker_env({"PATH": f"{Path(sys.executable).parent}:{worker_env()['PATH']}",
                      "HPC_RLHF_HOME": str(REPO)})
    # Open MPI settings the script wrote (root, oversubscription, no shared memory across fake nodes).
    dumped = subprocess.run(["bash", "-c", f"source {shlex.quote(prefix)}/env.sh && env -0"], capture_output=True,
                            text=True, check=True).stdout
    env.update(kv.split("=", 1) for kv in dumped.split("\0") if kv.startswith("OMPI_"))
    env.update(rank_python(env))
    return ClusterState(LocalCluster(env), started_here)


def rank_python(env: dict[str, str]) -> dict[str, str]:
    """PYTHON for the jobs' ranks (launch/env.sh): forked from a zygote started here for the session's jobs
    (tests/zygote_python.py says why and how), unless HPC_RLHF_TEST_FRESH_INTERPRETERS=1 or it cannot start."""
    if os.environ.get(FRESH_VAR, "") == "1":
        return {}
    zygote = Zygote()
    try:
        zygote.start(env)
    except RuntimeError:
        return {}
    return {"PYTHON": zygote_python(), SOCKET_VAR: zygote.path}


def zygote_python() -> str:
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'tests' / 'zygote_python.py'))}"


def start_cluster_session(tmp_path_factory, needed: set[str]) -> None:
    """Bring the local cluster up and submit the jobs the collected tests need (fixture names), in the
    background (tests/background.py): the cluster tests run last and find their jobs finished."""
    background.start("cluster", _bring_up)
    if "lost_rank_jobs" in needed and not background.started("lost_rank_jobs"):
        root = tmp_path_factory.mktemp("lost_ranks")

        def submit_lost_rank_jobs(out=root):
            background.wait_for_the_cluster_jobs_turn()  # tests/background.py says why
            return _submit_lost_rank_jobs(_up_or_none(), out)

        background.start("lost_rank_jobs", submit_lost_rank_jobs)
    if "gpu_script_jobs" in needed and not background.started("gpu_script_jobs"):
        root = tmp_path_factory.mktemp("gpu_scripts")
        after = [name for name in ("lost_rank_jobs", "tiny_jobs") if background.started(name) or name in needed]

        def submit_gpu_script_jobs(out=root):
            background.wait_for_the_cluster_jobs_turn()
            for name in after:  # submitted after the session's other jobs, which its tests read first
                while not background.started(name):
                    time.sleep(0.1)
                background.result(name)
            return _submit_gpu_script_jobs(_up_or_none(), out)

        background.start("gpu_script_jobs", submit_gpu_script_jobs)
    if "tiny_jobs" in needed and not background.started("tiny_jobs"):
        root = tmp_path_factory.mktemp("cluster")
        lost_ranks_first = background.started("lost_rank_jobs")

        def submit_tiny_jobs(out=root):
            background.wait_for_the_cluster_jobs_turn()
            if lost_ranks_first:  # every job of the session runs at the same time: the long ones go in first
                background.result("lost_rank_jobs")
            return _submit_tiny_jobs(_up_or_none(), out)

        background.start("tiny_jobs", submit_tiny_jobs)


def _up_or_none() -> LocalCluster | None:
    return background.result("cluster").cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    start_cluster_session(tmp_path_factory, set())
    state = background.result("cluster")
    if state.cluster is None:
        pytest.skip(state.skip_reason)
    yield state.cluster
    # Leave the machine as the session found it; KEEP_LOCAL_SLURM=1 keeps it up for the next run.
    if state.started_here and os.environ.get("KEEP_LOCAL_SLURM") != "1":
        _script("down", timeout=120)


def _status_prefix() -> str:
    first = _script("status", timeout=60).stdout.splitlines()[0]  # "local slurm up (prefix /tmp/...)"
    return first.split("(prefix ", 1)[1].rstrip(")")


# ------------------------------------------------------------------------------------------------- the jobs
@dataclass
class Submitted:
    job_id: str
    output_dir: Path
    log: Path

    def metrics(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Preemption:
    """What the signalling thread did: the step it had seen when it sent SIGUSR1 (None: it never sent it), and for
    a slow stop the time limit it cut the job to (minutes; None: it did not)."""
    step_seen: int | None = None
    error: str | None = None
    cut_limit_min: int | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class TinyJobs:
    config: Path
    reference: Submitted
    preempted: Submitted
    preemption: Preemption
    mpirun: Submitted
    srun_pmix: Submitted
    submitit_job: object
    submitit_run: Submitted
    submitit_preemption: Preemption
    ppo: Submitted | None = None  # the default tiny job: SFT -> RM -> PPO on 4 ranks


def write_tiny_config(path: Path) -> Path:
    """The built-in tiny SFT, cut to STEPS logged steps with a short evaluation.

    Paths are absolute: submitit jobs run in the directory pytest was started from, which may not be the root.
    """
    from hpc_rlhf.config import TINY_ASSETS

    assets = REPO / TINY_ASSETS
    path.write_text(f"""\
model:
  path: {assets}/models/llama-tiny
data:
  train_files: [{assets}/data/sft_train.jsonl]
  eval_files: [{assets}/data/sft_eval.jsonl]
  max_eval_rows: 16
train:
  max_steps: {STEPS}
  batch_size: 8
  micro_batch_size: 2
  warmup_steps: 2
eval:
  prompt_files: [{assets}/data/prompts_eval.jsonl]
  max_rows: 8
log:
  every_steps: 1
  eval_every_steps: 0
  progress: false
  tensorboard: false
""")
    return path


# The signaller runs in a process of its own: a thread of the pytest process sent the signal 14 s after the job's
# second step (fresh-clone suites of 2026-11-29, twice; that job's 50 steps took 10 s), while the lane ran other
# tests, so the job had ended. It reads the metrics every 0.1 s and asks the scheduler for the job's state (scontrol,
# slow under load) at most every STATE_POLL_S; it prints one JSON line: the step it saw, or the error.
SIGNALLER = """
import json, subprocess, sys, time
job_id, metrics, min_step, deadline_s, pending_s, poll_s = sys.argv[1:7]
deadline, next_state = time.monotonic() + float(deadline_s), 0.0
def say(**what):
    print(json.dumps(what), flush=True)
    sys.exit(0)
while time.monotonic() < deadline:
    try:
        with open(metrics) as f:
            steps = [json.loads(line)["step"] for line in f if line.strip()]
    except (OSError, ValueError, KeyError):  # not started, or a line half written
        steps = []
    if steps and max(steps) >= int(min_step):
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True, capture_output=True, timeout=60)
        say(step_seen=max(steps))
    if time.monotonic() >= next_state:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=60).stdout
        state = dict(item.split("=", 1) for item in out.split() if "=" in item).get("JobState")
        if state == "PENDING":
            deadline = max(deadline, time.monotonic() + float(pending_s))
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            say(error=f"the job ended ({state}) before it could be signalled")
        next_state = time.monotonic() + float(poll_s)
    time.sleep(0.1)
say(error=f"no step was logged within {pending_s} s of the job's start")
"""


def _signal_when_running(cluster: LocalCluster, job: Submitted, record: Preemption, min_step: int = 2) -> None:
    # The deadline counts from when the job runs: a job submitted with the session's others may wait its turn.
    try:
        proc = subprocess.run([sys.executable, "-c", SIGNALLER, job.job_id, str(job.output_dir / "metrics.jsonl"),
                               str(min_step), str(QUEUE_WAIT_S + JOB_TIMEOUT_S), str(JOB_TIMEOUT_S),
                               str(STATE_POLL_S)], cwd=REPO, env=cluster.env, capture_output=True, text=True,
                              timeout=2 * (QUEUE_WAIT_S + JOB_TIMEOUT_S))
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            record.error = f"the signaller exited {proc.returncode}: {proc.stderr[-2000:]}"
        else:
            said = json.loads(lines[-1])
            record.step_seen, record.error = said.get("step_seen"), said.get("error")
    except Exception as exc:  # noqa: BLE001 - reported by the test that reads the record
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done.set()


# ppo_70b's shrunk run, first run only (the probe sets it when SLURM_RESTART_COUNT is 0): its critic rank hangs as
# it enters step 2's checkpoint, ignoring the stop signals (a frozen rank would be woken by the SIGCONT with which
# Slurm ends a job, and the tiny job then checkpoints within KillWait), so only SIGKILL ends it.
SLOW_STOP_FAULT = "rank=1,phase=checkpoint,step=2,kind=hang"
SLOW_STOP_MARGIN_S = 170  # REQUEUE_MARGIN_S of that job: more than the 60-120 s left once the limit is cut
SLOW_STOP_GUARD_POLL_S = 2


def _stall_then_cut_the_limit(cluster: LocalCluster, job: Submitted, record: Preemption) -> None:
    """A stop that overruns, on a real Slurm: once the hung rank has announced itself in the job's log, send the
    stop signal (which it cannot answer), then cut the job's time limit to 60-120 s from now (whole minutes:
    Slurm keeps limits in minutes), inside the requeue guard's margin. The guard must requeue the job; the
    requeued run gets its 15 minutes back while it waits for its begin time (Slurm holds a requeued job a few
    seconds), so its own guard sees a far limit."""
    deadline = time.monotonic() + QUEUE_WAIT_S + JOB_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            fields = cluster.job_fields(job.job_id)
            state = fields.get("JobState")
            if state == "PENDING":
                deadline = max(deadline, time.monotonic() + JOB_TIMEOUT_S)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                record.error = f"the job ended ({state}) before its rank hung"
                return
            if job.log.is_file() and "injected fault (HPC_RLHF_FAULT" in job.log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        else:
            record.error = f"no rank hung within {JOB_TIMEOUT_S} s of the job's start"
            return
        record.step_seen = max((row["step"] for row in job.metrics()), default=0)
        cluster.run(["scancel", "--signal=USR1", job.job_id])
        started = datetime.fromisoformat(fields["StartTime"]).timestamp()
        record.cut_limit_min = int(time.time() - started) // 60 + 2
        cluster.run(["scontrol", "update", f"JobId={job.job_id}", f"TimeLimit={record.cut_limit_min}"])
        restore_by = time.monotonic() + 5 * SLOW_STOP_MARGIN_S
        while time.monotonic() < restore_by:
            if cluster.job_fields(job.job_id).get("Restarts", "0") != "0":
                cluster.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=15"])
                return
            time.sleep(0.2)
        record.error = "the job was not requeued after its time limit was cut"
    except Exception as exc:  # noqa: BLE001 - reported by the test that reads the record
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done.set()


@dataclass
class LostRankJob:
    """A 6-rank PPO job that loses `rank` (of `role`) by `kind` at `phase` of `step` (HPC_RLHF_FAULT)."""
    job: Submitted
    rank: int
    role: str
    phase: str
    step: int
    kind: str


LOST_RANK_PLACEMENT = "actor=1,critic=1,ref+reward=1,rollout=1"  # sbatch/tiny_cpu.sbatch's PPO, 2 nodes x 2 tasks
# (role, phase, step, kind): what only a Slurm job shows. The actor's rank is rank 0, beside the store's process
# (hpc_rlhf.dist.store_host, which srun's ranks have and torchrun's do not): killed, the others must still name
# it with its phase. The rollout rank, on the other node, is frozen: found only by its silence, killed by the rank
# that found it, and srun must then end the step on both nodes. Each role losing a rank in each kind of phase
# is tests/trainers/test_failures.py's (the same job under torchrun and the local launcher). Every fault comes
# after the first collective of all ranks (the exchange of step 1), so that every rank has set up and can report
# it (a rank still loading dies of srun's SIGTERM without a word): the rollout engine generates step 1 before
# that, so its case is at step 2.
LOST_RANK_CASES = (("rollout", "rollout", 2, "freeze"), ("actor", "weight_sync", 1, "kill"))
# These jobs run beside the other jobs of the session on two cores: a healthy rank must never go this long
# without a heartbeat, and a frozen one is found after it.
LOST_RANK_HEARTBEAT_S = 20
# A PPO step of a few samples (as in tests/trainers/test_failures.py): the jobs fail in step 1.
SMALL_PPO = ["data.eval_files=[]", "log.eval_every_steps=0", "log.progress=false", "log.tensorboard=false",
             "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4", "train.batch_size=8",
             "train.micro_batch_size=8", "critic_train.batch_size=8", "critic_train.micro_batch_size=8",
             "train.max_steps=3", "checkpoint.every_steps=1", "dist.timeout_s=300"]


def _submit_lost_rank_jobs(cluster: LocalCluster | None, root: Path) -> list[LostRankJob]:
    """sbatch/tiny_cpu.sbatch's PPO on 2 nodes x 2 tasks (actor and critic on node1, ref+reward and the rollout
    engine on node2), every role starting from the built-in tiny model: one job per case of LOST_RANK_CASES (the
    actor's rank killed, the rollout engine's frozen)."""
    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.data.assets import ensure_assets
    from hpc_rlhf.dist.placement import make_plan

    if cluster is None:
        return []
    ensure_assets(REPO / TINY_ASSETS)
    model = REPO / TINY_ASSETS / "models" / "llama-tiny"
    plan = make_plan(LOST_RANK_PLACEMENT, 4, 2)
    jobs = []
    for role, phase, step, kind in LOST_RANK_CASES:
        rank, name = plan.role(role).ranks[-1], f"{kind}_{role}"
        fault = f"rank={rank},phase={phase},step={step},kind={kind}"
        job_id = cluster.sbatch("--nodes=2", "--ntasks-per-node=2", "--time=15", f"--output={root}/{name}-%j.out",
                                "sbatch/tiny_cpu.sbatch", *SMALL_PPO,
                                env={"OUT": str(root / name), "ACTOR": str(model), "REWARD": str(model),
                                     "PLACEMENT": LOST_RANK_PLACEMENT, "HPC_RLHF_FAULT": fault,
                                     "HPC_RLHF_HEARTBEAT_TIMEOUT_S": str(LOST_RANK_HEARTBEAT_S)})
        job = Submitted(job_id, root / name / "ppo", Path(f"{root}/{name}-{job_id}.out"))
        jobs.append(LostRankJob(job, rank, role, phase, step, kind))
    return jobs


@pytest.fixture(scope="session")
def lost_rank_jobs(cluster: LocalCluster, tmp_path_factory) -> list[LostRankJob]:
    start_cluster_session(tmp_path_factory, {"lost_rank_jobs"})
    return background.result("lost_rank_jobs")


def _submit_tiny_jobs(cluster: LocalCluster | None, root: Path) -> TinyJobs | None:
    if cluster is None:
        return None
    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.data.assets import ensure_assets

    ensure_assets(REPO / TINY_ASSETS)  # once here, not by five jobs at the same time
    config = write_tiny_config(root / "sft.yaml")

    def tiny(name: str) -> Submitted:
        # One rank on each node (the default PPO job below has two on each): six fewer fresh interpreters.
        out = root / name
        job_id = cluster.sbatch("--ntasks-per-node=1", f"--output={root}/{name}-%j.out", "sbatch/tiny_cpu.sbatch",
                                f"output_dir={out}", env={"MODE": "sft", "CONFIG": str(config)})
        return Submitted(job_id, out, Path(f"{root}/{name}-{job_id}.out"))

    def wrapped(name: str, nodes: int, tasks: int, command: str) -> Submitted:
        out = root / name
        script = command.format(probe=shlex.quote(PROBE), config=config, out=out, py=shlex.quote(sys.executable),
                                launch=shlex.quote(str(REPO / "launch")))
        job_id = cluster.sbatch(f"--nodes={nodes}", f"--ntasks={tasks}", f"--output={root}/{name}-%j.out",
                                "--time=15", f"--wrap={script}")
        return Submitted(job_id, out, Path(f"{root}/{name}-{job_id}.out"))

    preempted = tiny("preempted")  # first: its signal must arrive while it trains
    record = Preemption()
    threading.Thread(target=_signal_when_running, args=(cluster, preempted, record), daemon=True).start()
    reference = tiny("reference")
    train = ("sft --config {config} output_dir={out} dist.nproc=2 dist.backend=gloo "
             f"train.max_steps={MPI_STEPS}")
    # One node: mpirun starts both ranks itself, so they carry the batch step's SLURM_PROCID=0 and our
    # bootstrap must take rank, size and master address from MPI. The training runs through the entry points
    # users run (launch/mpirun.sh, launch/srun.sh).
    mpirun = wrapped("mpirun", 1, 2, "mpirun -n 2 {py} -c {probe} && PYTHON={py} {launch}/mpirun.sh -n 2 -- " + train)
    srun_pmix = wrapped("srun_pmix", 2, 2, "srun --mpi=pmix {py} -c {probe} && "
                                           "PYTHON={py} {launch}/srun.sh --mpi=pmix -- " + train)
    from hpc_rlhf.launch.slurm import submit

    submitit_dir = root / "submitit"
    job = submit("sft", str(config), [f"output_dir={root / 'submitit_run'}", "dist.backend=gloo"], nodes=2,
                 tasks_per_node=1, time_min=15, folder=submitit_dir)
    # Preempted too: the task itself must requeue the job (rank 0) and submitit must wait for the second run.
    submitit_run = Submitted(job.job_id, root / "submitit_run", submitit_dir / job.job_id / f"{job.job_id}_0_log.err")
    submitit_record = Preemption()
    threading.Thread(target=_signal_when_running, args=(cluster, submitit_run, submitit_record), daemon=True).start()
    ppo_out = root / "ppo_job"
    ppo_id = cluster.sbatch(f"--output={root}/ppo_job-%j.out", "sbatch/tiny_cpu.sbatch", "train.max_steps=3",
                            "log.eval_every_steps=0", "log.progress=false",
                            env={"OUT": str(ppo_out), "SFT_STEPS": "20", "RM_STEPS": "10"})
    ppo = Submitted(ppo_id, ppo_out / "ppo", Path(f"{root}/ppo_job-{ppo_id}.out"))
    return TinyJobs(config, reference, preempted, record, mpirun, srun_pmix, job, submitit_run, submitit_record,
                    ppo)


@pytest.fixture(scope="session")
def tiny_jobs(cluster: LocalCluster, tmp_path_factory) -> TinyJobs:
    start_cluster_session(tmp_path_factory, {"tiny_jobs"})
    return background.result("tiny_jobs")


# ------------------------------------------------------------------------- the GPU scripts, shrunk to CPU
# Each GPU sbatch script runs as users submit it (its own file, its example config by default, its checks), on both
# fake nodes with the built-in tiny model for every role: the allocation, the placement and the model, data and
# batch keys are overridden on the sbatch command line and by the variables the scripts document (sbatch/README.md,
# "Shrunk runs"); everything else (ZeRO stage, Adam offload, checkpoint settings, ...) is the example config's.
# ppo_70b's run is preempted once and must requeue itself and resume.
GPU_SCRIPT_STEPS = 3
SMOKE_STEPS = 2  # as examples/cluster/smoke_gpu.yaml
PPO_70B_STEPS = 4  # one step more: the preemption lands after step 1 and the resumed run still has steps to go
# The scripts' own leads (up to 1,500 s for ppo_70b) exceed the shrunk jobs' 15 minutes: Slurm would signal at once.
SHRUNK_STOP_LEAD_S = 300
SHRUNK_CPUS_PER_TASK = 2  # ppo_70b's run: each rank must see it (SRUN_CPUS_PER_TASK, sbatch/common.sh)
# script -> (tasks per node, placement or None for the one-model modes)
SHRUNK_LAYOUTS = {
    "sft.sbatch": (1, None),
    "rm.sbatch": (1, None),
    "dpo.sbatch": (1, None),
    "grpo_7b.sbatch": (1, "actor+ref=1,rollout=1"),
    "ppo_7b.sbatch": (2, "actor+ref=1,critic+reward=1,rollout=2"),
    "ppo_70b.sbatch": (2, "actor=1,critic=1,ref+reward=1,rollout=1"),
    "smoke_gpu.sbatch": (1, "actor+ref=1,rollout=1"),  # gloo across the nodes, one vLLM CPU engine of tp 1
}
# What each rank's python says first (PYTHON names this wrapper): the CPUs Slurm gave its task.
CPU_PROBE = """#!/bin/bash
case "${{SLURM_STEP_ID:-batch}}" in
  [0-9]|[0-9][0-9]) printf 'CPUS rank=%s step=%s cpus_per_task=%s srun_cpus_per_task=%s\\n' "$SLURM_PROCID" \\
                    "$SLURM_STEP_ID" "${{SLURM_CPUS_PER_TASK:-}}" "${{SRUN_CPUS_PER_TASK:-}}" ;;
esac
if [ -n "${{FIRST_RUN_FAULT:-}}" ] && [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  export HPC_RLHF_FAULT=$FIRST_RUN_FAULT
fi
exec {python} "$@"
"""


@dataclass
class ScriptRun:
    script: str
    job: Submitted
    steps: int
    placement: str | None
    preemption: Preemption | None = None


def shrunk_steps(script: str) -> int:
    return {"ppo_70b.sbatch": PPO_70B_STEPS, "smoke_gpu.sbatch": SMOKE_STEPS}.get(script, GPU_SCRIPT_STEPS)


def shrunk_overrides(script: str, out: Path) -> list[str]:
    """The key=value arguments of a shrunk run: tiny model and data, a few small steps, gloo, the hf engine."""
    from hpc_rlhf.config import TINY_ASSETS

    assets = REPO / TINY_ASSETS
    model, data = assets / "models" / "llama-tiny", assets / "data"
    common = [f"output_dir={out}", "data.eval_files=[]", "data.max_prompt_len=16", "data.max_len=32",
              "dist.backend=gloo", "dist.timeout_s=300", "log.every_steps=1", "log.tensorboard=false",
              "train.warmup_steps=0"]
    steps = shrunk_steps(script)
    if script in ("sft.sbatch", "rm.sbatch", "dpo.sbatch"):
        train_file = data / ("sft_train.jsonl" if script == "sft.sbatch" else "pref_train.jsonl")
        return [*common, f"model.path={model}", f"data.train_files=[{train_file}]", f"train.max_steps={steps}",
                "train.batch_size=8", "train.micro_batch_size=4"]
    rl = [*common, f"actor.path={model}", f"data.train_files=[{data / 'prompts_train.jsonl'}]",
          "rollout.backend=hf", "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4",
          f"train.max_steps={steps}", "train.batch_size=8", "train.micro_batch_size=8"]
    if script == "grpo_7b.sbatch":
        return rl
    if script == "smoke_gpu.sbatch":  # its own engine, vLLM (CPU build here), with room for its 16 samples
        return [*rl, "rollout.backend=vllm", "train.batch_size=16", "rollout.prompts_per_step=4",
                "rollout.n_samples=4"]
    if script == "ppo_70b.sbatch":  # a checkpoint every step, and a hung rank left to the requeue guard
        rl += ["checkpoint.every_steps=1", "dist.heartbeat_timeout_s=600"]
    return [*rl, f"critic.path={model}", f"reward.models=[{model}]", f"critic_train.max_steps={steps}",
            "critic_train.batch_size=8", "critic_train.micro_batch_size=8", "critic_train.warmup_steps=0"]


def _submit_gpu_script_jobs(cluster: LocalCluster | None, root: Path) -> dict[str, ScriptRun]:
    if cluster is None:
        return {}
    from hpc_rlhf.config import TINY_ASSETS
    from hpc_rlhf.data.assets import ensure_assets

    ensure_assets(REPO / TINY_ASSETS)
    probe = root / "python"
    probe.write_text(CPU_PROBE.format(python=zygote_python() if SOCKET_VAR in cluster.env else
                                      shlex.quote(sys.executable)))
    probe.chmod(0o755)
    runs = {}
    for script, (per_node, placement) in sorted(SHRUNK_LAYOUTS.items(), key=lambda kv: kv[0] != "ppo_70b.sbatch"):
        name = script.removesuffix(".sbatch")
        out = root / name
        cpus = SHRUNK_CPUS_PER_TASK if script == "ppo_70b.sbatch" else 1
        # The script's own directives ask for 4 nodes x 8 GPUs, 12 CPUs a task, whole nodes and a day: the command
        # line shrinks them to the fake nodes (no GPUs) and 15 minutes, and lets the session's other jobs share the
        # nodes.
        env = {"PYTHON": str(probe)} | ({"PLACEMENT": placement} if placement else {})
        if script == "ppo_70b.sbatch":  # a stop that overruns: the requeue guard must requeue it
            env |= {"FIRST_RUN_FAULT": SLOW_STOP_FAULT, "REQUEUE_MARGIN_S": str(SLOW_STOP_MARGIN_S),
                    "REQUEUE_GUARD_POLL_S": str(SLOW_STOP_GUARD_POLL_S)}
        env["STOP_LEAD_S"] = str(SHRUNK_STOP_LEAD_S)
        job_id = cluster.sbatch("--nodes=2", f"--ntasks-per-node={per_node}", "--gpus-per-node=0",
                                f"--cpus-per-task={cpus}", "--oversubscribe", "--time=15",
                                f"--signal=USR1@{SHRUNK_STOP_LEAD_S}",
                                f"--output={root}/{name}-%j.out", f"sbatch/{script}", *shrunk_overrides(script, out),
                                env=env)
        job = Submitted(job_id, out, Path(f"{root}/{name}-{job_id}.out"))
        runs[script] = ScriptRun(script, job, shrunk_steps(script), placement)
        if script == "ppo_70b.sbatch":
            record = runs[script].preemption = Preemption()
            threading.Thread(target=_stall_then_cut_the_limit, args=(cluster, job, record), daemon=True).start()
    return runs


@pytest.fixture(scope="session")
def gpu_script_jobs(cluster: LocalCluster, tmp_path_factory) -> dict[str, ScriptRun]:
    start_cluster_session(tmp_path_factory, {"gpu_script_jobs"})
    return background.result("gpu_script_jobs")
