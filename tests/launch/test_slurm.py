"""hpc_rlhf.launch.slurm without a cluster: submitit parameters, the job submitted through stand-in `sbatch` and
`srun` commands, requeue through a stand-in `scontrol`, and the task's reaction to each exit of a mode."""

from __future__ import annotations

import os
import pickle
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import submitit
from submitit.slurm.slurm import _make_sbatch_string

from hpc_rlhf.launch import modes
from hpc_rlhf.launch import slurm
from hpc_rlhf.launch.slurm import (PREEMPTED_EXIT_CODE, REQUEUE_GUARD, SlurmLaunchError, TrainingTask,
                                   forget_the_submitters_world, requeue_self, should_requeue, slurm_parameters,
                                   submit, task_args)
from hpc_rlhf.runtime.checkpointing import Preempted


def sbatch_lines(params: dict) -> list[str]:
    """The #SBATCH lines submitit writes for these parameters (its own renderer, which also rejects unknown
    keywords, as SlurmExecutor.update_parameters does)."""
    text = _make_sbatch_string(command="true", folder="/tmp/x/%j", **params)
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


# ------------------------------------------------------------------------------------------ slurm_parameters
def test_parameters_map_onto_sbatch_options():
    params = slurm_parameters(nodes=4, tasks_per_node=8, gpus_per_node=8, cpus_per_task=12, time_min=120,
                              partition="gpu", account="proj", signal_delay_s=300)
    lines = sbatch_lines(params)
    for expected in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12", "--time=120",
                     "--partition=gpu", "--account=proj", "--signal=USR1@300", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {expected}" in lines, (expected, lines)
    # Our USR1 replaces submitit's USR2 (one --signal line, not two).
    assert sum(line.startswith("#SBATCH --signal") for line in lines) == 1


def test_cpu_job_asks_for_no_gpus_and_no_site_options():
    lines = sbatch_lines(slurm_parameters())
    assert not any(opt in " ".join(lines) for opt in ("--gpus-per-node", "--partition", "--account"))
    assert "#SBATCH --nodes=1" in lines and "#SBATCH --ntasks-per-node=1" in lines


def test_job_side_submitit_handler_uses_the_trainers_signal():
    text = _make_sbatch_string(command="true", folder="/tmp/x/%j", **slurm_parameters(signal_delay_s=90))
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in text
    assert text.index("SUBMITIT_PREEMPT_SIGNAL") < text.index("srun")  # set before the tasks start


def test_the_job_script_starts_the_requeue_guard_before_the_tasks():
    text = _make_sbatch_string(command="true", folder="/tmp/x/%j", **slurm_parameters(signal_delay_s=90))
    guard = REQUEUE_GUARD.read_text()
    assert guard.strip().splitlines()[-1] in text  # inlined: the job's shell may not see this installation
    # margin: at most half the signal's lead by default; the task's max_restarts
    assert " requeue_guard 45 100 $$ &" in text and text.index("requeue_guard 45") < text.index("srun")
    text = _make_sbatch_string(command="true", folder="/tmp/x/%j",
                               **slurm_parameters(signal_delay_s=600, requeue_margin_s=200))
    assert " requeue_guard 200 100 $$ &" in text
    assert " requeue_guard 120 " in _make_sbatch_string(command="true", folder="/tmp/x/%j",
                                                        **slurm_parameters(signal_delay_s=600))


def test_the_job_script_makes_the_store_secret_in_the_job_not_in_the_script():
    """`hpc-rlhf submit`'s job script (a file other users may read) holds no secret: its shell makes one before
    srun starts the tasks, which inherit it, unless the user's environment gave one (store_guard)."""
    text = _make_sbatch_string(command="true", folder="/tmp/x/%j", **slurm_parameters())
    [line] = [line for line in text.splitlines() if "HPC_RLHF_STORE_SECRET=" in line]
    assert text.index(line) < text.index("srun")

    def secret_made(**env: str) -> str:
        return subprocess.run(["bash", "-c", f'{line}\nprintf %s "$HPC_RLHF_STORE_SECRET"'], capture_output=True,
                              text=True, check=True, env={"PATH": os.environ["PATH"], **env}).stdout

    first, second = secret_made(), secret_made()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and first != second and first not in text
    assert secret_made(HPC_RLHF_STORE_SECRET="users-own") == "users-own"


@pytest.mark.parametrize("margin", [90, 120, -1, 1.5])
def test_a_requeue_margin_that_leaves_the_ranks_no_time_is_refused(margin):
    with pytest.raises(SlurmLaunchError, match=r"requeue_margin_s .*signal_delay_s \(90 s\)"):
        slurm_parameters(signal_delay_s=90, requeue_margin_s=margin)


def test_extra_slurm_options_are_added_and_win():
    lines = sbatch_lines(slurm_parameters(extra_slurm={"qos": "high", "mail_type": "END",
                                                       "signal": "USR1@500"}))
    assert "#SBATCH --qos=high" in lines and "#SBATCH --mail-type=END" in lines
    assert "#SBATCH --signal=USR1@500" in lines


@pytest.mark.parametrize("kwargs, named", [
    ({"nodes": 0}, "nodes"),
    ({"tasks_per_node": 0}, "tasks_per_node"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"cpus_per_task": 1.5}, "cpus_per_task"),
    ({"time_min": True}, "time_min"),
])
def test_bad_numbers_are_refused_by_name(kwargs, named):
    with pytest.raises(SlurmLaunchError, match=named):
        slurm_parameters(**kwargs)


def test_time_limit_must_leave_room_after_the_signal():
    slurm_parameters(time_min=3, signal_delay_s=120)  # 180 s = 120 + 60: just enough
    with pytest.raises(SlurmLaunchError, match=r"time_min=2 .*signal_delay_s \(120 s\)"):
        slurm_parameters(time_min=2, signal_delay_s=120)


# ------------------------------------------------------------------------------------------------- task args
def test_task_args_add_the_world_size_unless_given():
    assert task_args("c.yaml", ["train.lr=1e-4"], 8) == ["--config", "c.yaml", "train.lr=1e-4", "dist.nproc=8"]
    assert task_args(None, ["dist.nproc=2"], 8) == ["dist.nproc=2"]


@pytest.mark.parametrize("bad", ["train.lr", "--debug"])
def test_task_args_refuse_what_is_not_key_value(bad):
    with pytest.raises(SlurmLaunchError, match="not key=value"):
        task_args(None, [bad], 1)


def test_container_python_runs_inside_apptainer_with_gpus():
    assert slurm.container_python(None) is None
    assert slurm.container_python("/img/my image.sif") == "apptainer exec --nv '/img/my image.sif' python"


# ------------------------------------------------------------------------------------ stand-in Slurm commands
def install_fakes(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def test_submit_writes_the_job_and_pickles_the_task(tmp_path, monkeypatch):
    log = tmp_path / "sbatch.log"
    install_fakes(tmp_path, monkeypatch, srun="exit 0\n",
                  sbatch=f'echo "$@" >> {log}; echo "Submitted batch job 77"\n')
    config = tmp_path / "c.yaml"
    config.write_text("train: {max_steps: 2}\n")
    job = submit("sft", str(config), ["train.lr=1e-4"], nodes=2, tasks_per_node=4, gpus_per_node=4,
                 time_min=30, folder=tmp_path / "sub", container="/img/x.sif")
    assert job.job_id == "77"
    text = (tmp_path / "sub" / "77" / "77_submission.sh").read_text()
    for expected in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--time=30", "--signal=USR1@60",
                     "--requeue", "--job-name=hpc_rlhf-sft"):
        assert f"#SBATCH {expected}" in text
    assert "apptainer exec --nv /img/x.sif python -u -m submitit.core._submit" in text
    with open(tmp_path / "sub" / "77" / "77_submitted.pkl", "rb") as f:
        task = pickle.load(f).function
    assert isinstance(task, TrainingTask) and task.mode == "sft"
    assert task.args == ["--config", str(config), "train.lr=1e-4", "dist.nproc=8"]


def test_submit_refuses_what_cannot_run_before_touching_slurm(tmp_path):
    with pytest.raises(SlurmLaunchError, match="'plan' is a command, not a training mode"):
        submit("plan")
    with pytest.raises(SlurmLaunchError, match="'sftt' is not a mode"):
        submit("sftt")
    with pytest.raises(SlurmLaunchError, match="config file .*missing.yaml does not exist"):
        submit("sft", str(tmp_path / "missing.yaml"))


def test_requeue_self_calls_scontrol_for_this_job(tmp_path, monkeypatch):
    log = tmp_path / "scontrol.log"
    install_fakes(tmp_path, monkeypatch, scontrol=f'echo "$@" >> {log}\n')
    assert requeue_self(env={"SLURM_JOB_ID": "123"}) == "123"
    assert requeue_self("456", env={}) == "456"
    assert log.read_text().splitlines() == ["requeue 123", "requeue 456"]


def test_requeue_self_reports_why_it_failed(tmp_path, monkeypatch):
    with pytest.raises(SlurmLaunchError, match="SLURM_JOB_ID is not set"):
        requeue_self(env={})
    install_fakes(tmp_path, monkeypatch,
                  scontrol='echo "scontrol: error: Job has already finished" >&2; exit 1\n')
    with pytest.raises(SlurmLaunchError, match="requeue 9 failed \\(exit 1\\): scontrol: error: Job has already"):
        requeue_self(env={"SLURM_JOB_ID": "9"})


@pytest.mark.parametrize("code, restarts, limit, expected", [
    (75, 0, 3, True), (75, 2, 3, True), (75, 3, 3, False), (0, 0, 3, False), (1, 0, 3, False), (143, 0, 3, False),
])
def test_should_requeue(code, restarts, limit, expected):
    assert should_requeue(code, restarts, limit) is expected


# ------------------------------------------------------------------------------------------------- the task
@pytest.fixture
def restore_sigterm():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def preempted_mode(argv):
    raise Preempted(step=7)


def test_preempted_rank0_requeues_and_ends_without_a_result(tmp_path, monkeypatch, restore_sigterm):
    log = tmp_path / "scontrol.log"
    install_fakes(tmp_path, monkeypatch, scontrol=f'echo "$@" >> {log}\n')
    monkeypatch.setattr(modes, "run", preempted_mode)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(SystemExit) as exit_info:
        TrainingTask("sft", [])()
    assert exit_info.value.code == PREEMPTED_EXIT_CODE
    assert log.read_text().splitlines() == ["requeue 31"]
    # srun's SIGTERM to the remaining ranks, or a stop signal delivered late, must not turn their exit code 75
    # into 143 or 138 while Python shuts down.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


# A rank that checkpointed for a stop request, then exits while SIGUSR1 and SIGTERM keep arriving (late stop
# signals from a slow node, srun's SIGTERM after the first rank exited 75): it must still exit with 75.
PREEMPTED_RANK = textwrap.dedent("""
    import signal, sys, time
    from hpc_rlhf.launch import modes, slurm
    from hpc_rlhf.runtime.checkpointing import Preempted, StopSignal

    stop = StopSignal()
    def preempted(argv):
        print("ready", flush=True)
        while stop.received is None:
            time.sleep(0.001)
        raise Preempted(step=1)
    modes.run = preempted
    sys.exit(slurm.run_rank(["sft"]))
""")


@pytest.mark.parametrize("late", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_preempted_rank_exits_75_while_stop_signals_keep_arriving(late):
    child = subprocess.Popen([sys.executable, "-c", PREEMPTED_RANK], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout.readline().strip() == "ready"
    while child.poll() is None:  # through the shutdown, when Python puts the default actions back
        try:
            os.kill(child.pid, late)
        except ProcessLookupError:
            break
    assert child.wait(timeout=60) == PREEMPTED_EXIT_CODE


def test_preempted_other_ranks_leave_the_requeue_to_rank0(tmp_path, monkeypatch, restore_sigterm):
    log = tmp_path / "scontrol.log"
    install_fakes(tmp_path, monkeypatch, scontrol=f'echo "$@" >> {log}\n')
    monkeypatch.setattr(modes, "run", preempted_mode)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(SystemExit, match=str(PREEMPTED_EXIT_CODE)):
        TrainingTask("sft", [])()
    assert not log.exists()


def test_preempted_too_often_fails_instead_of_requeueing(monkeypatch, restore_sigterm):
    monkeypatch.setattr(modes, "run", preempted_mode)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    with pytest.raises(RuntimeError, match="preempted again after 5 restarts"):
        TrainingTask("sft", [], max_restarts=5)()


def test_failed_mode_raises_with_its_code_and_success_returns(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setattr(modes, "run", lambda argv: 2)
    with pytest.raises(RuntimeError, match="hpc-rlhf sft failed on rank 2 with exit code 2"):
        TrainingTask("sft", [])()
    calls = []
    monkeypatch.setattr(modes, "run", lambda argv: calls.append(argv) or 0)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert TrainingTask("dpo", ["--config", "d.yaml"])() == {"rank": 2, "exit_code": 0, "restarts": 0}
    assert calls == [["dpo", "--config", "d.yaml"]]


def test_the_task_forgets_the_world_of_the_process_that_submitted_it(monkeypatch):
    # A job gets the submitting process's environment; there, a mode run in-process had exported its one-rank world.
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="41000",
                            TORCHELASTIC_USE_AGENT_STORE="True", SLURM_PROCID="1", SLURM_NTASKS="2").items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(modes, "run", lambda argv: seen.update(os.environ) or 0)
    TrainingTask("sft", [])()
    gone = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}
    assert not gone & set(seen)
    assert (seen["SLURM_PROCID"], seen["SLURM_NTASKS"]) == ("1", "2")


def test_a_master_address_chosen_by_the_submitter_stays():
    env = {"MASTER_ADDR": "node01-ib", "MASTER_PORT": "29555", "SLURM_PROCID": "0"}
    assert forget_the_submitters_world(env) == [] and env["MASTER_ADDR"] == "node01-ib"


def test_checkpoint_resubmits_the_same_task():
    task = TrainingTask("sft", ["a=1"])
    delayed = task.checkpoint()
    assert isinstance(delayed, submitit.helpers.DelayedSubmission)
    assert delayed.function is task and delayed.args == () and delayed.kwargs == {}


def test_rank_subcommand_runs_the_mode(monkeypatch, restore_sigterm):
    seen = []
    monkeypatch.setattr(modes, "run", lambda argv: seen.append(argv) or 0)
    assert slurm.main(["rank", "sft", "train.lr=1"]) == 0
    assert seen == [["sft", "train.lr=1"]]


def test_cli_refuses_a_bad_slurm_option(capsys):
    assert slurm.main(["sft", "--slurm", "qos"]) == 2
    assert "--slurm 'qos' is not KEY=VALUE" in capsys.readouterr().err


def test_a_refused_requeue_still_ends_the_task_without_a_result(tmp_path, monkeypatch, capsys, restore_sigterm):
    install_fakes(tmp_path, monkeypatch, scontrol='echo "Requested operation is presently disabled" >&2; exit 1\n')
    monkeypatch.setattr(modes, "run", preempted_mode)
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    with pytest.raises(SystemExit, match=str(PREEMPTED_EXIT_CODE)):
        TrainingTask("sft", [])()
    assert "checkpoint written; requeue_self: scontrol requeue 8 failed" in capsys.readouterr().err
