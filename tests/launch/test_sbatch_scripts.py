"""The sbatch scripts without a cluster: syntax, required directives, their placement against their own
allocation, and the batch logic of sbatch/common.sh run for real with stand-in `srun` and `scontrol`."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.dist.launch_env import SLURM_PORT_BASE, SLURM_PORT_SPAN
from hpc_rlhf.dist.placement import make_plan

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "sbatch"
SCRIPTS = sorted(SBATCH.glob("*.sbatch"))
NAMES = {p.name for p in SCRIPTS}
GPU_SCRIPTS = [p for p in SCRIPTS if p.name != "tiny_cpu.sbatch"]


def directives(path: Path) -> dict[str, str]:
    """`#SBATCH --key=value` lines that sbatch reads: those before the first command of the script."""
    found = {}
    for line in path.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", stripped)
        if match:
            found[match.group(1)] = match.group(2) or ""
    return found


def default_of(path: Path, variable: str) -> str | None:
    match = re.search(rf"^{variable}=\$\{{{variable}:-([^}}]*)\}}", path.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def layout_of(path: Path) -> str | None:
    """The placement a role-mode script runs: its PLACEMENT default, else its config's `placement`."""
    default = default_of(path, "PLACEMENT")
    config = default_of(path, "CONFIG")
    if default or not config or "$" in config:
        return default
    return yaml.safe_load((REPO / config).read_text()).get("placement")


def test_the_expected_scripts_exist():
    assert {"tiny_cpu.sbatch", "ppo_70b.sbatch", "ppo_7b.sbatch", "grpo_7b.sbatch", "sft.sbatch", "rm.sbatch",
            "dpo.sbatch"} <= NAMES


@pytest.mark.parametrize("path", SCRIPTS + [SBATCH / "common.sh"], ids=lambda p: p.name)
def test_bash_syntax(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_required_directives_come_before_the_first_command(path):
    found = directives(path)
    assert re.fullmatch(r"USR1@\d+", found.get("signal", "")), found
    assert "requeue" in found and found.get("open-mode") == "append"
    assert int(found["nodes"]) >= 1 and int(found["ntasks-per-node"]) >= 1 and "time" in found
    if path in GPU_SCRIPTS:
        assert found["gpus-per-node"] == found["ntasks-per-node"]  # one rank per GPU


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_each_script_checks_the_plan_before_training_through_common_sh(path):
    text = path.read_text()
    assert 'source "${HPC_RLHF_HOME:-$SLURM_SUBMIT_DIR}/sbatch/common.sh"' in text
    calls = [line.strip().split()[0] for line in text.splitlines() if line.strip().startswith("hpc_")]
    # set-up, the plan check, then one or more training steps (tiny_cpu makes its starting models first)
    assert calls[:2] == ["hpc_setup", "hpc_check_plan"] and len(calls) >= 3 and calls[-1] == "hpc_train"
    assert set(calls[2:]) <= {"hpc_train", "hpc_bandwidth"}  # smoke_gpu measures the fabric first
    # srun and its flags live in launch/srun.sh, the requeue in common.sh only
    assert not any(line.lstrip().startswith(("srun", "scontrol")) for line in text.splitlines())


def test_signal_delay_leaves_room_within_the_time_limit():
    for path in SCRIPTS:
        found = directives(path)
        hours, minutes, seconds = (int(x) for x in found["time"].split(":"))
        delay = int(found["signal"].split("@")[1])
        assert delay + 60 <= hours * 3600 + minutes * 60 + seconds, path.name


@pytest.mark.parametrize("path", [p for p in SCRIPTS if layout_of(p)], ids=lambda p: p.name)
def test_default_placement_fits_the_scripts_own_allocation(path):
    found = directives(path)
    per_node = int(found["ntasks-per-node"])
    plan = make_plan(layout_of(path), int(found["nodes"]) * per_node, per_node)
    assert plan.world_size == int(found["nodes"]) * per_node


def test_ppo_70b_is_the_32_gpu_layout():
    path = SBATCH / "ppo_70b.sbatch"
    found = directives(path)
    assert (found["nodes"], found["ntasks-per-node"], found["gpus-per-node"]) == ("4", "8", "8")
    assert default_of(path, "PLACEMENT") is None  # the config's placement, the one its dry run checks
    plan = make_plan(layout_of(path), 32, 8)
    assert {name: role.size for name, role in plan.roles.items()} == {"actor": 8, "critic": 8, "ref": 4,
                                                                      "reward": 4, "rollout": 8}
    assert [len(e) for e in plan.role("rollout").engines] == [4, 4]


def test_tiny_job_mode_and_config_are_single_variables():
    text = (SBATCH / "tiny_cpu.sbatch").read_text()
    assert "MODE=${MODE:-ppo}" in text and "CONFIG=${CONFIG-examples/tiny/$MODE.yaml}" in text
    found = directives(SBATCH / "tiny_cpu.sbatch")
    assert (found["nodes"], found["ntasks-per-node"]) == ("2", "2") and "gpus-per-node" not in found


def test_common_sh_starts_ranks_through_launch_srun_sh_and_requeues_on_75():
    text = (SBATCH / "common.sh").read_text()
    code = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    assert any(line.startswith('"$HPC_RLHF_HOME/launch/srun.sh"') for line in code)
    assert not any(line.startswith("srun") for line in code)
    assert "HPC_PREEMPTED_EXIT_CODE=75" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "exec srun --kill-on-bad-exit=1" in (REPO / "launch" / "srun.sh").read_text()
    assert "apptainer exec --nv" in (REPO / "launch" / "env.sh").read_text()


# ---------------------------------------------------------------------------- common.sh run with stand-ins
FAKE_SRUN = """#!/bin/bash
printf 'srun' >> "$FAKE_LOG"; printf ' %q' "$@" >> "$FAKE_LOG"; echo >> "$FAKE_LOG"
env | grep -E '^(MASTER_ADDR|MASTER_PORT|NCCL_[A-Z_]+|SRUN_CPUS_PER_TASK|HF_[A-Z_]+_OFFLINE)=' | sort >> "$FAKE_LOG"
# the tasks' store secret, apart from the log (which the test compares with the job's output)
printf '%s\n' "${HPC_RLHF_STORE_SECRET:-}" >> "$FAKE_LOG.secret"
exit "${FAKE_SRUN_EXIT:-0}"
"""
# `scontrol show node LIST` (the job's node list, or one name) prints a record with RealMemory=$FAKE_REAL_MEMORY_NAME
# (MiB) for each node that has that set, and says on stderr that the others are not found; each request is logged.
FAKE_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node7\\nnode8\\n'; exit 0; fi
if [ "$1 $2" = "show node" ]; then
  echo "scontrol $*" >> "$FAKE_LOG.scontrol"
  case "$3" in node\\[*) names="node7 node8" ;; *) names=$3 ;; esac
  for name in $names; do
    memory=FAKE_REAL_MEMORY_$name
    if [ -z "${!memory:-}" ]; then echo "Node $name not found" >&2; continue; fi
    printf 'NodeName=%s Arch=x86_64 CoresPerSocket=16\\n   CPUAlloc=0 CPUEfctv=32 CPUTot=32 CPULoad=0.01\\n' "$name"
    printf '   RealMemory=%s AllocMem=0 FreeMem=1000 Sockets=2 Boards=1\\n   State=IDLE ThreadsPerCore=1\\n\\n' \\
      "${!memory}"
  done
  exit 0
fi
echo "scontrol $*" >> "$FAKE_LOG"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / "calls.log"

    def run(script: str, *args: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "MASTER_"))
               and k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
        env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), PYTHON=sys.executable,
                   SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[7-8]", SLURM_NTASKS="4",
                   SLURM_TASKS_PER_NODE="2(x2)", SLURM_SUBMIT_DIR=str(REPO), CONFIG="",
                   CHECK_FILES="0")  # the example configs' folders are placeholders; the real files' check: below
        env.update(env_extra)
        env = {k: v for k, v in env.items() if v is not None}  # None: unset
        proc = subprocess.run(["bash", str(SBATCH / script), *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
        return proc, log.read_text() if log.exists() else ""

    return run


def test_a_finished_step_is_not_requeued(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", "train.max_steps=3")
    assert proc.returncode == 0, proc.stderr
    srun = next(line for line in calls.splitlines() if line.startswith("srun"))
    assert srun.startswith("srun --kill-on-bad-exit=1 ")
    assert " -m hpc_rlhf.launch.slurm rank sft " in srun
    # Our settings first, the command line's last (later overrides win), the world size for a 1-group mode.
    assert srun.index("dist.nproc=4") < srun.index("output_dir=runs/tiny_cpu-4242") < srun.index("max_steps=3")
    # the port the bootstrap derives too (hpc_rlhf.dist.launch_env), below the ephemeral range
    assert "MASTER_ADDR=node7" in calls and f"MASTER_PORT={SLURM_PORT_BASE + 4242 % SLURM_PORT_SPAN}" in calls
    assert SLURM_PORT_BASE + SLURM_PORT_SPAN <= 32768
    assert "requeue" not in calls


def test_the_tasks_get_one_store_secret_per_job_that_the_job_never_prints(fake_slurm, tmp_path):
    """sbatch/common.sh makes the job's store secret once (launch/env.sh hpc_store_secret) and srun hands it to
    every task; it is never in the job's output. A requeued job (another batch shell) makes a new one; one the
    user set is kept."""
    secrets = tmp_path / "calls.log.secret"

    def job_secrets(users_secret: str | None = None) -> set[str]:
        """The secrets the job's srun steps were given (the session's own, which an in-process world exports into
        this process's environment, is not handed on: unset unless `users_secret`)."""
        seen = len(secrets.read_text().split()) if secrets.exists() else 0
        proc, calls = fake_slurm("tiny_cpu.sbatch", "train.max_steps=3", HPC_RLHF_STORE_SECRET=users_secret)
        assert proc.returncode == 0, proc.stderr
        given = set(secrets.read_text().split()[seen:])
        assert not any(secret in proc.stdout + proc.stderr + calls for secret in given)
        return given

    [secret] = job_secrets()  # one for every step of the job
    assert re.fullmatch(r"[0-9a-f]{64}", secret)  # 32 random bytes
    assert job_secrets() != {secret}
    assert job_secrets("users-own") == {"users-own"}


def test_exit_75_requeues_the_job(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", FAKE_SRUN_EXIT="75")
    assert proc.returncode == 75
    assert "scontrol requeue 4242" in calls
    assert "requeueing job 4242" in proc.stdout


def test_a_failure_is_not_requeued(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", FAKE_SRUN_EXIT="1")
    assert proc.returncode == 1 and "requeue" not in calls


def test_requeues_stop_at_max_restarts(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", FAKE_SRUN_EXIT="75", SLURM_RESTART_COUNT="3", MAX_RESTARTS="3")
    assert proc.returncode == 75 and "requeue" not in calls
    assert "MAX_RESTARTS=3" in proc.stdout


def test_a_placement_that_does_not_fit_stops_before_srun(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_NTASKS="3", SLURM_TASKS_PER_NODE="2,1",
                             PLACEMENT="actor=4")
    assert proc.returncode == 2
    assert "the config does not start on this allocation (3 ranks, 2 per node; placement 'actor=4')" in proc.stderr
    assert re.search(r"--dry-run: (command line: )?placement", proc.stderr)  # the check's own line names the key
    assert "srun" not in calls


def test_role_modes_get_the_checked_placement(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", MODE="ppo", PLACEMENT="actor=1,critic=1,ref+reward=1,rollout=1")
    assert proc.returncode == 0, proc.stderr
    sruns = [line for line in calls.splitlines() if line.startswith("srun")]
    # The SFT and RM steps that make PPO's starting models, then PPO itself with the checked placement.
    assert [" sft " in sruns[0], " rm " in sruns[1]] == [True, True] and "dist.nproc=4" in sruns[0]
    assert "placement=actor=1\\,critic=1\\,ref+reward=1\\,rollout=1" in sruns[-1] and "dist.nproc" not in sruns[-1]


def test_a_role_mode_without_placement_runs_the_configs_own(fake_slurm):
    """PLACEMENT unset: the dry run and the ranks both read the config's placement (examples/tiny/grpo.yaml:
    actor=1,ref=1,rollout=2 on the 4 tasks); one that does not fit the allocation is refused before srun."""
    proc, calls = fake_slurm("tiny_cpu.sbatch", MODE="grpo", CONFIG=None)
    assert proc.returncode == 0, proc.stderr
    assert "placement=<from the config>" in proc.stdout and "the plan fits" in proc.stdout
    srun = next(line for line in calls.splitlines() if line.startswith("srun"))
    assert " grpo --config examples/tiny/grpo.yaml " in srun and "placement=" not in srun
    proc, later_calls = fake_slurm("tiny_cpu.sbatch", MODE="grpo", CONFIG=None, SLURM_NTASKS="3",
                                   SLURM_TASKS_PER_NODE="2,1")
    assert proc.returncode == 2 and "srun" not in later_calls[len(calls):]
    assert "placement 'from the config'" in proc.stderr


def test_the_check_weighs_host_memory_from_host_memory_gb_or_the_jobs_mem(fake_slurm):
    """HOST_MEMORY_GB, else the job's --mem (SLURM_MEM_PER_NODE, MiB), is the node memory the dry run checks; with
    neither, and no RealMemory from scontrol, the job log says on stderr that it was not checked. 4 tiny ranks need
    their processes' 4 x 4 GB per node of 2."""
    proc, calls = fake_slurm("tiny_cpu.sbatch", HOST_MEMORY_GB="6")
    assert proc.returncode == 2 and "srun" not in calls
    assert "node 0 needs 8 GB of host memory, more than 6 GB (--host-memory-gb)" in proc.stderr
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_MEM_PER_NODE="16000")  # 16.8 GB
    assert proc.returncode == 0 and "node memory 16.8 GB" in proc.stdout, proc.stderr
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_MEM_PER_NODE="0")  # and scontrol knows neither node
    assert proc.returncode == 0 and "node memory not given (--host-memory-gb): not checked" in proc.stdout
    assert "host memory not checked: set HOST_MEMORY_GB" in proc.stderr
    assert "'scontrol show node node[7-8]' gave no RealMemory for node7" in proc.stderr


def test_with_mem_0_the_check_weighs_the_smallest_realmemory_of_the_jobs_nodes(fake_slurm, tmp_path):
    """--mem=0 (ppo_70b) or no --mem: the node memory is scontrol's RealMemory (MiB), the smallest over the job's
    nodes (node7, node8); the 4 tiny ranks need 8 GB per node."""
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_MEM_PER_NODE="0", FAKE_REAL_MEMORY_node7="64000",
                             FAKE_REAL_MEMORY_node8="16000")  # 16.8 GB
    assert proc.returncode == 0 and "node memory 16.8 GB" in proc.stdout, proc.stderr
    # one request for the job's nodes, not one a node (a large job's start would send slurmctld hundreds)
    assert (tmp_path / "calls.log.scontrol").read_text().splitlines() == ["scontrol show node node[7-8]"]
    assert "host memory not checked" not in proc.stdout + proc.stderr
    proc, later_calls = fake_slurm("tiny_cpu.sbatch", FAKE_REAL_MEMORY_node7="64000", FAKE_REAL_MEMORY_node8="5000")
    assert proc.returncode == 2 and "srun" not in later_calls[len(calls):]
    assert "node 0 needs 8 GB of host memory, more than 5.2 GB (--host-memory-gb)" in proc.stderr
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_MEM_PER_NODE="0", FAKE_REAL_MEMORY_node7="64000",
                             FAKE_REAL_MEMORY_node8="unknown")
    assert proc.returncode == 0 and "'scontrol show node node[7-8]' gave no RealMemory for node8" in proc.stderr
    assert "node memory not given (--host-memory-gb): not checked" in proc.stdout
    # Slurm's RealMemory for a node the administrator gave none: 1 MiB, which must not refuse every job.
    proc, calls = fake_slurm("tiny_cpu.sbatch", FAKE_REAL_MEMORY_node7="1", FAKE_REAL_MEMORY_node8="64000")
    assert proc.returncode == 0 and "node node7 has RealMemory=1 MiB (not configured" in proc.stderr
    proc, calls = fake_slurm("tiny_cpu.sbatch", SLURM_MEM_PER_NODE="0", HOST_MEMORY_GB="6",
                             FAKE_REAL_MEMORY_node7="64000", FAKE_REAL_MEMORY_node8="64000")
    assert proc.returncode == 2 and "more than 6 GB (--host-memory-gb)" in proc.stderr  # HOST_MEMORY_GB first


def test_nccl_settings_reach_the_ranks_only_when_set(fake_slurm):
    proc, calls = fake_slurm("tiny_cpu.sbatch", NCCL_SOCKET_IFNAME="ib0", NCCL_DEBUG="INFO")
    assert proc.returncode == 0, proc.stderr
    assert "NCCL_SOCKET_IFNAME=ib0" in calls and "NCCL_DEBUG=INFO" in calls and "NCCL_IB_HCA" not in calls
    assert "NCCL settings: NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=ib0" in proc.stdout


def test_container_runs_ranks_in_apptainer_with_nv(fake_slurm, tmp_path):
    image = tmp_path / "hpc_rlhf.sif"
    image.write_bytes(b"not a real image")
    fake_apptainer = tmp_path / "bin" / "apptainer"
    # The plan check runs on the batch host through the same command: pass it on to the real python.
    fake_apptainer.write_text(f'#!/bin/bash\nshift 4; exec {sys.executable} "$@"\n')
    fake_apptainer.chmod(stat.S_IRWXU)
    proc, calls = fake_slurm("tiny_cpu.sbatch", CONTAINER=str(image))
    assert proc.returncode == 0, proc.stderr
    srun = next(line for line in calls.splitlines() if line.startswith("srun"))
    assert f"srun --kill-on-bad-exit=1 apptainer exec --nv {image} python -m hpc_rlhf.launch.slurm rank" in srun


def test_missing_container_image_is_refused(fake_slurm, tmp_path):
    proc, calls = fake_slurm("tiny_cpu.sbatch", CONTAINER=str(tmp_path / "absent.sif"))
    assert proc.returncode == 2 and "absent.sif is not a file" in proc.stderr and "srun" not in calls


def allocation_env(path: Path) -> dict[str, str]:
    """The Slurm variables of a job of the script's own allocation."""
    found = directives(path)
    nodes, per_node = int(found["nodes"]), int(found["ntasks-per-node"])
    return {"SLURM_NTASKS": str(nodes * per_node), "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURM_CPUS_PER_TASK": found["cpus-per-task"], "CONFIG": None}


@pytest.mark.parametrize("path", GPU_SCRIPTS, ids=lambda p: p.name)
def test_gpu_scripts_check_their_example_config_and_give_the_ranks_what_was_checked(fake_slurm, path):
    proc, calls = fake_slurm(path.name, **allocation_env(path))
    assert proc.returncode == 0, proc.stderr
    assert "the plan fits" in proc.stdout  # the dry run's report, in the job log
    sruns = [line for line in calls.splitlines() if line.startswith("srun")]
    srun = sruns[-1]  # the training step (smoke_gpu's all-reduce comes first)
    assert f"--config examples/cluster/{path.stem}.yaml" in srun
    if path.stem == "smoke_gpu":
        assert len(sruns) == 2 and " -m hpc_rlhf.launch.slurm rank bandwidth --size-mb 256" in sruns[0]
    placement = default_of(path, "PLACEMENT")
    if placement:
        assert "placement=" + placement.replace(",", "\\,") in srun
    elif path.stem in ("ppo_70b", "ppo_7b", "grpo_7b"):
        assert "placement=" not in srun  # the config's, as its dry run checked
    # srun of Slurm 22.05-23.02 takes the CPUs per task from SRUN_CPUS_PER_TASK only.
    assert f"SRUN_CPUS_PER_TASK={directives(path)['cpus-per-task']}" in calls
    # offline on the PYTHON= path too (the container sets it in its own environment)
    assert "HF_DATASETS_OFFLINE=1" in calls and "HF_HUB_OFFLINE=1" in calls


@pytest.mark.parametrize("args,key", [(["train.adam_offload=false"], "train.adam_offload"),
                                      (["rollout.backend=hf"], "placement")])
def test_ppo_70b_refuses_a_config_that_contradicts_its_layout_before_srun(fake_slurm, args, key):
    path = SBATCH / "ppo_70b.sbatch"
    proc, calls = fake_slurm(path.name, *args, **allocation_env(path))
    assert proc.returncode == 2 and "srun" not in calls
    assert f"--dry-run: command line: {key}" in proc.stderr or f"--dry-run: {key}:" in proc.stderr, proc.stderr


def tiny_files(out: Path) -> list[str]:
    """ppo_70b's placeholders replaced by the built-in tiny model and prompts (ensured by the suite's set-up)."""
    from hpc_rlhf.config import TINY_ASSETS

    model, data = REPO / TINY_ASSETS / "models" / "llama-tiny", REPO / TINY_ASSETS / "data"
    return [f"actor.path={model}", f"critic.path={model}", f"reward.models=[{model}]", f"output_dir={out}",
            f"data.train_files=[{data / 'prompts_train.jsonl'}]"]


@pytest.mark.parametrize("typo, key, says", [
    (None, None, None),
    ("actor.path={models}/llama-tiyn", "actor.path", "model folder '.*llama-tiyn' does not exist"),
    ("output_dir=/proc/hpc_rlhf_out", "output_dir", "'/proc/hpc_rlhf_out' cannot be created or written"),
])
def test_the_job_reads_the_real_files_before_any_rank_starts(fake_slurm, tmp_path, typo, key, says):
    """CHECK_FILES=1, the default of the GPU scripts: a typo'd model folder, an output_dir that cannot be written:
    exit 2 naming the key, and srun never runs (each kind of problem: tests/launch/test_preflight.py)."""
    from hpc_rlhf.config import TINY_ASSETS

    path = SBATCH / "ppo_70b.sbatch"
    assets = REPO / TINY_ASSETS
    args = tiny_files(tmp_path / "out")
    if typo:
        args.append(typo.format(models=assets / "models", data=assets / "data"))
    proc, calls = fake_slurm(path.name, *args, **allocation_env(path), CHECK_FILES=None)
    if key is None:
        assert proc.returncode == 0 and "srun" in calls, proc.stderr
        assert "files checked:" in proc.stdout and "actor.path: tokenizer in" in proc.stdout
        return
    assert proc.returncode == 2 and "srun" not in calls, proc.stderr
    assert re.search(rf"--dry-run: {re.escape(key)}: .*({says})", proc.stderr), proc.stderr
