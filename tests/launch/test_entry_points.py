"""The launch entry points users run (launch/ beside hpc_rlhf/): one per way a job starts.

local.sh, torchrun.sh and (where Open MPI and mpi4py are installed) mpirun.sh start a real 2-rank SFT of the
built-in tiny model for 2 steps, from a folder outside the repository; the three must train the same 2-rank world,
so their seeded losses are equal. srun.sh and submit.py need Slurm: here they run against stand-in `srun` and
`sbatch` commands, and the tests check the command line and job they build (tests/cluster/ runs them on a real
Slurm). Every script documents at its top what it needs and how it is called.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.data.assets import ensure_assets
from tests.distributed import REPO, worker_env

LAUNCH = REPO / "launch"
SHELL_SCRIPTS = ["srun.sh", "mpirun.sh", "torchrun.sh", "local.sh"]
ENTRY_POINTS = SHELL_SCRIPTS + ["submit.py"]
# What a wrapped python prints before it runs: how our bootstrap sees the launch (no torch import).
PROBE = ("import os; from hpc_rlhf.dist.launch_env import detect_launch; i = detect_launch(); "
         "os.write(1, f'PROBE {i.launcher} {i.rank} {i.world_size}\\n'.encode())")


def tiny_sft(out: Path) -> list[str]:
    """2 steps of the built-in SFT on 2 ranks, every path absolute (the scripts run from another folder)."""
    assets = REPO / TINY_ASSETS
    return ["sft", "--config", str(REPO / "examples" / "tiny" / "sft.yaml"), f"model.path={assets}/models/llama-tiny",
            f"data.train_files=[{assets}/data/sft_train.jsonl]", "data.eval_files=[]", "eval.prompt_files=[]",
            "dist.nproc=2", "train.max_steps=2", "log.every_steps=1", "log.eval_every_steps=0",
            "log.progress=false", "log.tensorboard=false", f"output_dir={out}"]


def run_script(script: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = worker_env({"PYTHON": sys.executable, **(env or {})})
    full_env.pop("PYTHONPATH")  # the scripts use the installed package, not the test run's path
    command = [str(LAUNCH / script), *args] if script.endswith(".sh") else [sys.executable, str(LAUNCH / script),
                                                                             *args]
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2], rows
    return [row["loss"] for row in rows]


@pytest.fixture(scope="module")
def assets():
    ensure_assets(REPO / TINY_ASSETS)


@pytest.fixture(scope="module")
def local_losses(assets, tmp_path_factory) -> list[float]:
    """The reference: the 2-rank SFT through launch/local.sh."""
    folder = tmp_path_factory.mktemp("local")
    # Variables of an outer launcher (an interactive srun step of one task) must not make it a 1-rank world.
    outer = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
             "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "5"}
    proc = run_script("local.sh", tiny_sft(folder / "out"), cwd=folder, env=outer)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no launcher found; starting 2 ranks on this machine" in proc.stderr
    return losses(folder / "out")


# ---------------------------------------------------------------------------------------------- documented
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_entry_point_is_executable_and_says_what_it_needs_with_an_example(name):
    path = LAUNCH / name
    assert path.stat().st_mode & stat.S_IXUSR
    top = path.read_text().split("\nset -o pipefail", 1)[0] if name.endswith(".sh") else \
        path.read_text().split('"""')[1]
    assert "Needs:" in top
    example = "python launch/submit.py " if name == "submit.py" else f"launch/{name} "
    assert any(line.lstrip("# ").startswith(example) or f" launch/{name} " in line for line in top.splitlines())


@pytest.mark.parametrize("name", SHELL_SCRIPTS + ["env.sh"])
def test_bash_syntax(name):
    proc = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_without_a_mode_each_script_prints_its_usage(name, tmp_path):
    proc = run_script(name, [], cwd=tmp_path, env={"SLURM_JOB_ID": "1", "NPROC": "2"})
    assert proc.returncode == 2 and proc.stderr.startswith("usage:") and name in proc.stderr


# ---------------------------------------------------------------------------------------- run here for real
def test_local_sh_starts_the_ranks_itself_from_any_folder(local_losses):
    assert len(local_losses) == 2 and all(loss > 0 for loss in local_losses)


def test_torchrun_sh_trains_the_same_world(local_losses, tmp_path):
    proc = run_script("torchrun.sh", tiny_sft(tmp_path / "out"), cwd=tmp_path, env={"NPROC": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert losses(tmp_path / "out") == local_losses


@pytest.mark.mpi  # make venv installs Open MPI and mpi4py; a skip fails CI (tests/ci_skips.py)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed here (make venv installs it "
                                                           "as root; tests/cluster/ runs launch/mpirun.sh on Slurm)")
def test_mpirun_sh_trains_the_same_world_bootstrapped_by_mpi(local_losses, tmp_path):
    pytest.importorskip("mpi4py")
    # A python that says how it was launched, then runs the rank.
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/bash\n{shlex.quote(sys.executable)} -c {shlex.quote(PROBE)} && "
                       f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(stat.S_IRWXU)
    env = {"PYTHON": str(wrapper), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    proc = run_script("mpirun.sh", ["-n", "2", "--", *tiny_sft(tmp_path / "out")], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("PROBE")) == \
        ["PROBE mpi 0 2", "PROBE mpi 1 2"]
    assert losses(tmp_path / "out") == local_losses


# ----------------------------------------------------------------------- the command lines, with stand-ins
def stand_in(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(stat.S_IRWXU)
    return path


RECORD = 'printf "%q " "$(basename "$0")" "$@" > "$RECORD"; echo >> "$RECORD"\n'


def recorded(tmp_path: Path) -> list[str]:
    return shlex.split((tmp_path / "record").read_text())


def with_stand_ins(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    for name in ("srun", "mpirun"):
        stand_in(bin_dir, name, RECORD)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "record"), **extra}


def test_srun_sh_runs_every_task_as_a_rank_with_kill_on_bad_exit(tmp_path):
    env = with_stand_ins(tmp_path, SLURM_JOB_ID="42", SLURM_CPUS_PER_TASK="6")
    proc = run_script("srun.sh", ["--mpi=pmix", "--ntasks=4", "--", "sft", "--config", "my.yaml", "train.lr=1e-5"],
                      cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path) == ["srun", "--kill-on-bad-exit=1", "--mpi=pmix", "--ntasks=4", sys.executable, "-m",
                                  "hpc_rlhf.launch.slurm", "rank", "sft", "--config", "my.yaml", "train.lr=1e-5"]


def test_srun_sh_gives_the_ranks_one_thread_per_cpu_of_the_task(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "srun", 'echo "$OMP_NUM_THREADS $PYTHONUNBUFFERED" > "$RECORD"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "record"), "SLURM_JOB_ID": "42",
           "SLURM_CPUS_PER_TASK": "6"}
    full = worker_env(env)
    full.pop("OMP_NUM_THREADS")
    full.pop("PYTHONUNBUFFERED")
    proc = subprocess.run([str(LAUNCH / "srun.sh"), "sft"], cwd=tmp_path, env=full, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "record").read_text().split() == ["6", "1"]


def test_srun_sh_outside_an_allocation_says_so(tmp_path):
    env = with_stand_ins(tmp_path)
    full = worker_env({"PYTHON": sys.executable, **env})
    full.pop("SLURM_JOB_ID", None)
    proc = subprocess.run([str(LAUNCH / "srun.sh"), "sft"], cwd=tmp_path, env=full, capture_output=True, text=True)
    assert proc.returncode == 2 and "not inside a Slurm allocation" in proc.stderr
    assert not (tmp_path / "record").exists()


def test_srun_sh_runs_the_ranks_in_the_container(tmp_path):
    image = tmp_path / "hpc_rlhf.sif"
    image.write_bytes(b"not a real image")
    stand_in(tmp_path / "bin", "apptainer", "exit 0\n")
    proc = run_script("srun.sh", ["sft"], cwd=tmp_path,
                      env=with_stand_ins(tmp_path, SLURM_JOB_ID="42", CONTAINER=str(image)))
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path)[:6] == ["srun", "--kill-on-bad-exit=1", "apptainer", "exec", "--nv", str(image)]
    proc = run_script("srun.sh", ["sft"], cwd=tmp_path,
                      env=with_stand_ins(tmp_path, SLURM_JOB_ID="42", CONTAINER=str(tmp_path / "absent.sif")))
    assert proc.returncode == 2 and "absent.sif is not a file" in proc.stderr


def test_mpirun_sh_passes_its_options_to_mpirun_and_the_mode_to_every_rank(tmp_path):
    proc = run_script("mpirun.sh", ["-n", "16", "--map-by", "ppr:8:node", "--", "ppo", "placement=actor=16"],
                      cwd=tmp_path, env=with_stand_ins(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path) == ["mpirun", "-n", "16", "--map-by", "ppr:8:node", sys.executable, "-m", "hpc_rlhf",
                                  "ppo", "placement=actor=16"]


def test_torchrun_sh_is_standalone_with_nproc_unless_given_torchrun_options(tmp_path):
    fake_python = stand_in(tmp_path / "bin", "python", RECORD)
    env = {"PYTHON": str(fake_python), "RECORD": str(tmp_path / "record")}
    proc = run_script("torchrun.sh", ["sft", "dist.nproc=4"], cwd=tmp_path, env={**env, "NPROC": "4"})
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path) == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m",
                                  "hpc_rlhf", "sft", "dist.nproc=4"]
    proc = run_script("torchrun.sh", ["--nnodes=2", "--nproc_per_node=8", "--rdzv_endpoint=node1:29500", "--", "ppo"],
                      cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert recorded(tmp_path) == ["python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=8",
                                  "--rdzv_endpoint=node1:29500", "-m", "hpc_rlhf", "ppo"]
    proc = run_script("torchrun.sh", ["sft"], cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "set NPROC" in proc.stderr


def test_submit_py_queues_the_job_through_submitit_from_any_folder(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "sbatch", 'echo "Submitted batch job 77"\n')
    stand_in(bin_dir, "srun", "exit 0\n")
    config = tmp_path / "c.yaml"
    config.write_text("train: {max_steps: 2}\n")
    proc = run_script("submit.py", ["sft", "--config", str(config), "--nodes", "2", "--tasks-per-node", "4",
                                    "--time-min", "30", "--folder", str(tmp_path / "sub"), "--", "train.lr=1e-4"],
                      cwd=tmp_path, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert f"submitted job 77 (sft); logs in {tmp_path / 'sub' / '77'}" in proc.stdout
    text = (tmp_path / "sub" / "77" / "77_submission.sh").read_text()
    for expected in ("--nodes=2", "--ntasks-per-node=4", "--time=30", "--signal=USR1@60", "--requeue",
                     "--job-name=hpc_rlhf-sft"):
        assert f"#SBATCH {expected}" in text
    proc = run_script("submit.py", ["plan"], cwd=tmp_path)
    assert proc.returncode == 2 and "launch/submit.py: submit: 'plan' is a command, not a training mode" in proc.stderr
