"""Whole jobs that lose a rank, and non-finite losses.

Lost ranks: a PPO job with every role on ranks of its own (actor, critic, ref, reward, two rollout engines: 6
ranks) loses one rank of each role in turn (kill -9) at a different phase. These jobs run as a user starts them on
one machine (`python -m hpc_rlhf ppo`, forked from the tests' zygote, tests/cli_zygote.py: the local launcher forks
the ranks, rank 0 forks the store's process). Two GRPO jobs on 3 ranks (actor, ref, one rollout engine) run under
torchrun, whose agent hosts the store and SIGTERMs the survivors: rank 0 killed while it checkpoints, and the
rollout rank frozen (SIGSTOP), which ignores that SIGTERM. torchrun's agent and its workers fork from the tests'
zygote too (tests/distributed.py `torchrun`: each worker is a stand-in process of torchrun's, the rank a fork). The faults come from
HPC_RLHF_FAULT, so every run fails at the same point. The models are one random-init Llama of ~60K parameters,
used as actor and ref and, with a new value head, as critic and reward model. The job must end non-zero soon
after the failure, and every surviving rank must say which rank was lost, its role and its phase.

Non-finite losses: a GRPO job started the way a user starts it on a laptop (`python -m hpc_rlhf grpo ...`, the
local launcher starts the 4 ranks).

The one-model modes (sft, rm, dpo, kto) run in-process on a one-rank world, three tiny steps each: a nan fault
skips exactly its step, and a failure leaves the watchdog (whose report names them) at its step and phase.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS, load_config
from hpc_rlhf.dist import watchdog
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.dist.watchdog import HEARTBEAT_TIMEOUT_ENV
from hpc_rlhf.utils import checkpoint as ckpt
from hpc_rlhf.utils.faults import FAULT_ENV, InjectedFault
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import run_python, torchrun, worker_env
from tests.recipes import QUIET

HEARTBEAT_TIMEOUT_S = 8  # 6 ranks on 2 cores: a busy rank must not look like a frozen one
# How soon after the injected failure the whole job must have ended: the heartbeat timeout (a frozen rank is
# found only by its silence) plus time to notice, report and exit on two busy cores. It is below the 30 s that
# torchrun waits for a rank to obey its SIGTERM, which a frozen rank never does: a job that stays until
# torchrun kills that rank fails here.
END_BOUND_S = HEARTBEAT_TIMEOUT_S + 21
# Only against a hang of the test itself: start-up of 6 ranks on 2 busy cores, two steps, the failure.
JOB_LIMIT_S = 400
PPO_PLACEMENT = "actor=1,critic=1,ref=1,reward=1,rollout=2"
GRPO_PLACEMENT = "actor=1,ref=1,rollout=1"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A random-init Llama of ~60K parameters with the built-in tokenizer: a Hugging Face folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpc_rlhf.models.tiny import copy_tokenizer

    folder = tmp_path_factory.mktemp("model")
    config = AutoConfig.for_model("llama", vocab_size=104, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


SMALL_RL_STEP = [f"data.train_files=[{TINY_ASSETS}/data/prompts_train.jsonl]", "data.eval_files=[]",
                 "log.eval_every_steps=0", "log.progress=false", "log.tensorboard=false",
                 "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4",
                 "train.batch_size=8", "train.micro_batch_size=8", "critic_train.batch_size=8",
                 "critic_train.micro_batch_size=8", "train.max_steps=3", "dist.timeout_s=120"]


def lost_rank_job(launcher: str, model: Path, out: Path, fault: str,
                  *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    """A job checkpointing every step: with `launcher` "local" the PPO job on 6 ranks, forked by `python -m
    hpc_rlhf` itself; with "torchrun" the GRPO job on 3 ranks. Returns the finished process and the wall-clock time
    (time.time()) at which the test saw it end."""
    common = [f"output_dir={out}", f"actor.path={model}", "checkpoint.every_steps=1", *SMALL_RL_STEP]
    env = worker_env({FAULT_ENV: fault, HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_TIMEOUT_S)})
    if launcher == "local":
        # The causal-LM folder serves as critic and reward model too: each gets a new value head.
        args = ["ppo", *common, f"critic.path={model}", f"reward.models=[{model}]", f"placement={PPO_PLACEMENT}",
                *overrides]
        proc = run_python("hpc_rlhf", None, args, env=env, timeout=JOB_LIMIT_S)
    else:
        args = ["grpo", *common, f"placement={GRPO_PLACEMENT}", *overrides]
        proc = torchrun(["--standalone", f"--nproc_per_node={job_plan(launcher).world_size}", "--max_restarts=0",
                         "-m", "hpc_rlhf", *args], env=env, timeout=JOB_LIMIT_S)
    return proc, time.time()


def job_plan(launcher: str):
    """The placement plan of `lost_rank_job`'s job for `launcher`: one node holding every rank."""
    placement, ranks = (PPO_PLACEMENT, 6) if launcher == "local" else (GRPO_PLACEMENT, 3)
    return make_plan(placement, ranks, ranks)


def grpo(model: Path, out: Path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    """A GRPO job on the local launcher's ranks (4 unless the overrides place them otherwise)."""
    args = [f"output_dir={out}", f"actor.path={model}", "placement=actor=1,ref=1,rollout=2", *SMALL_RL_STEP,
            *overrides]
    env = worker_env({FAULT_ENV: fault, HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_TIMEOUT_S)})
    return run_python("hpc_rlhf", None, ["grpo", *args], env=env, timeout=JOB_LIMIT_S)


def watchdog_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpc_rlhf: rank")]


def injected_at(stdout: str) -> tuple[int, str, int, float]:
    """(rank, phase, step, unix time) of the one injected fault that fired (faults.point prints it)."""
    found = re.findall(r"hpc_rlhf: injected fault \(.*\) at rank (\d+), phase (\w+), step (\d+) "
                       r"\[unix time ([\d.]+)\]", stdout)
    assert len(found) == 1, stdout[-3000:]
    rank, phase, step, when = found[0]
    return int(rank), phase, int(step), float(when)


# (launcher, role, index of the rank within the role, phase, step, kind, what the others say). One kill per role,
# each in another phase; `exchange` is the responses' broadcast after generation, the first exchange of a step.
# Every fault comes after the first collective of all ranks (the exchange of step 1), so that every other rank
# has finished setting up and survives torchrun's SIGTERM long enough to report (a rank still setting up dies
# of it at once: see watchdog._note_sigterm). The reward rank, which generates nothing, reaches the exchange of
# step 1 before the others are set up: its case is at step 2. The last case runs asynchronously
# (rl.max_staleness=1): the engine dies generating batch 2 while the actor and critic train on batch 1.
# (Its prefill phase, `rollout_prefill`, comes before the first collective of all ranks: see above.)
# tests/cluster/test_watchdog_slurm.py has the same job under srun.
LOSSES = [
    pytest.param("torchrun", "actor", 0, "checkpoint", 2, "kill", "failed", (), id="torchrun-kill-actor-checkpoint"),
    pytest.param("torchrun", "rollout", 0, "weight_sync", 1, "freeze", "stopped responding", (),
                 id="torchrun-freeze-rollout-weight-sync"),
    pytest.param("local", "critic", 0, "training", 2, "kill", "failed", (), id="local-kill-critic-training"),
    pytest.param("local", "ref", 0, "scoring", 1, "kill", "failed", (), id="local-kill-ref-scoring"),
    pytest.param("local", "reward", 0, "exchange", 2, "kill", "failed", (), id="local-kill-reward-exchange"),
    pytest.param("local", "rollout", 1, "rollout", 2, "kill", "failed", (), id="local-kill-rollout-generating"),
    pytest.param("local", "rollout", 1, "rollout", 2, "kill", "failed", ("rl.max_staleness=1",),
                 id="local-kill-rollout-generating-ahead"),
]


@pytest.mark.parametrize("launcher, role, index, phase, step, kind, verb, overrides", LOSSES)
def test_a_lost_rank_ends_the_job_naming_its_rank_role_and_phase(model, tmp_path, launcher, role, index, phase, step,
                                                                 kind, verb, overrides):
    plan = job_plan(launcher)
    rank = plan.role(role).ranks[index]
    out = tmp_path / "run"
    proc, ended = lost_rank_job(launcher, model, out, f"rank={rank},phase={phase},step={step},kind={kind}",
                                *overrides)
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert injected_at(proc.stdout)[:3] == (rank, phase, step)
    after = ended - injected_at(proc.stdout)[3]
    assert after < END_BOUND_S, f"the job ended {after:.0f} s after the failure\n{proc.stderr[-4000:]}"

    # Every surviving rank names the lost rank, its role and phase (the store outlives any rank: torchrun's agent
    # serves it, or rank 0's store process, so every line can say where the lost rank was).
    lines = watchdog_lines(proc.stderr)
    expected = f"hpc_rlhf: rank {rank} (role {role}) {verb} during {phase}: "
    assert lines and all(line.startswith(expected) and f"[step {step};" in line for line in lines), \
        "\n".join(lines) or proc.stderr[-4000:]
    seen_by = sorted(int(re.search(r"seen by rank (\d+)\]", line).group(1)) for line in lines)
    assert seen_by == [r for r in range(plan.world_size) if r != rank], "\n".join(lines)

    # Nothing that was saved is lost: the checkpoints before the failure are complete.
    found = ckpt.latest_complete(out)
    assert (found[0] if found else 0) == step - 1


def test_non_finite_steps_are_skipped_by_the_whole_role_and_too_many_stop_the_run(model, tmp_path):
    out = tmp_path / "run"
    # The second actor rank's loss is NaN at step 2, and again from step 4 on; the first rank's stays finite.
    proc = grpo(model, out, "kind=nan,rank=1,step=2;kind=nan,rank=1,step=4+",
                "placement=actor=2,ref=1,rollout=1", "train.micro_batch_size=4", "train.max_steps=8",
                "train.max_bad_steps=2", "checkpoint.every_steps=0")
    assert proc.returncode != 0
    message = ("grpo: 2 optimizer steps in a row had a non-finite loss or gradient (last at step 5); stopping "
               "(train.max_bad_steps=2)")
    assert message in proc.stderr, proc.stderr[-4000:]
    metrics = {m["step"]: m for m in read_metrics(out)}
    assert sorted(metrics) == [1, 2, 3, 4]  # step 5 ended the run before it was logged
    # Logged by rank 0, whose own loss was finite: it skipped with its role.
    assert [metrics[s]["actor_skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert [metrics[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 2]
    assert math.isfinite(metrics[3]["actor_grad_norm"])  # a finite step after a skipped one updates again


# ------------------------------------------------------------------------------------------- one-model modes
ONE_MODEL_MODES = ["sft", "rm", "dpo", "kto"]
# Two micro-batches per step, a learning rate still warming up at step 3, evaluation at step 2 (and before the
# first step), no checkpoint: a few seconds per mode.
THREE_TINY_STEPS = ["train.max_steps=3", "train.batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=3",
                    "log.every_steps=1", "log.eval_every_steps=2", "data.max_train_rows=16", "data.max_eval_rows=4",
                    "checkpoint.every_steps=0", "checkpoint.resume=false", *QUIET]


def run_one_model_mode(mode: str, out: Path) -> None:
    import importlib

    recipe = importlib.import_module(f"hpc_rlhf.trainers.{mode}")
    generation_eval_off = [] if mode == "rm" else ["eval.prompt_files=[]"]  # rm has no generation evaluation
    recipe.run(load_config(recipe.Config, None, [f"output_dir={out}", *THREE_TINY_STEPS, *generation_eval_off]))


@pytest.mark.parametrize("mode", ONE_MODEL_MODES)
def test_a_nan_fault_skips_exactly_its_step_in_every_one_model_mode(world, monkeypatch, tmp_path, mode):
    monkeypatch.setenv(FAULT_ENV, "rank=0,phase=training,step=2,kind=nan")
    run_one_model_mode(mode, tmp_path / mode)
    rows = {row["step"]: row for row in read_metrics(tmp_path / mode) if row["step"] > 0}
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["skipped_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [math.isfinite(float(rows[s]["loss"])) for s in (1, 2, 3)] == [True, False, True]
    assert [math.isfinite(float(rows[s]["grad_norm"])) for s in (1, 2, 3)] == [True, False, True]
    # The skipped update leaves the learning-rate schedule where it was: step 3 runs at step 2's rate.
    assert rows[1]["lr"] < rows[2]["lr"] == rows[3]["lr"]


@pytest.mark.parametrize("phase", ["training", "eval"])
@pytest.mark.parametrize("mode", ONE_MODEL_MODES)
def test_a_failure_in_a_one_model_mode_is_reported_at_its_step_and_phase(world, monkeypatch, tmp_path, mode, phase):
    monkeypatch.setenv(FAULT_ENV, f"rank=0,phase={phase},step=2,kind=raise")
    with pytest.raises(InjectedFault, match=f"at rank 0, phase {phase}, step 2$"):
        run_one_model_mode(mode, tmp_path / mode)
    # What the watchdog publishes for a failing rank (watchdog.report_failure) and every peer prints.
    assert (watchdog.current_step(), watchdog.current_phase()) == (2, phase)
    assert [row["step"] for row in read_metrics(tmp_path / mode)] == [0, 1]  # step 2's row is never written
