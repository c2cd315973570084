"""Whole GRPO jobs that lose a rank: killed (kill -9) or frozen (SIGSTOP) in one role after another, at different
phases, and non-finite losses. The job is started the way a user starts it on a laptop (`python -m hpc_rlhf
grpo ...`, no launcher: the local launcher starts the 4 ranks) with a random-init model of ~60K parameters, and
the faults come from HPC_RLHF_FAULT, so every run fails at the same point."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.dist.watchdog import HEARTBEAT_TIMEOUT_ENV
from hpc_rlhf.utils import checkpoint as ckpt
from hpc_rlhf.utils.faults import FAULT_ENV
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import REPO, worker_env

HEARTBEAT_TIMEOUT_S = 4
# Startup of 4 ranks on 2 busy cores plus the bound on noticing the failure (heartbeat timeout, the local
# launcher's 5 s grace to the survivors).
JOB_LIMIT_S = 150


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


def grpo(model: Path, out: Path, fault: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    """A 3-step GRPO job on 4 local ranks; returns the finished process and its wall time."""
    args = [f"output_dir={out}", f"actor.path={model}", "placement=actor=1,ref=1,rollout=2",
            f"data.train_files=[{TINY_ASSETS}/data/prompts_train.jsonl]", "data.eval_files=[]",
            "log.eval_every_steps=0", "log.progress=false", "log.tensorboard=false",
            "rollout.prompts_per_step=4", "rollout.n_samples=2", "rollout.max_new_tokens=4",
            "train.batch_size=8", "train.micro_batch_size=8", "critic_train.batch_size=8",
            "train.max_steps=3", "dist.timeout_s=120", *overrides]
    env = worker_env({FAULT_ENV: fault, HEARTBEAT_TIMEOUT_ENV: str(HEARTBEAT_TIMEOUT_S)})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf", "grpo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=JOB_LIMIT_S + 60)
    return proc, time.monotonic() - start


def watchdog_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpc_rlhf: rank")]


# (rank, role, phase, step, kind, what the others say). Ranks: actor 0, ref 1, rollout 2 and 3.
LOSSES = [
    pytest.param(1, "ref", "scoring", 1, "kill", "failed", id="kill-ref-scoring"),
    pytest.param(3, "rollout", "rollout", 2, "kill", "failed", id="kill-rollout-generating"),
    pytest.param(0, "actor", "checkpoint", 2, "kill", "failed", id="kill-actor-checkpoint"),
    pytest.param(2, "rollout", "weight_sync", 1, "freeze", "stopped responding", id="freeze-rollout-weight-sync"),
]


@pytest.mark.parametrize("rank, role, phase, step, kind, verb", LOSSES)
def test_a_lost_rank_ends_the_job_with_its_rank_and_role(model, tmp_path, rank, role, phase, step, kind, verb):
    out = tmp_path / "run"
    proc, elapsed = grpo(model, out, f"rank={rank},phase={phase},step={step},kind={kind}",
                         "checkpoint.every_steps=1")
    assert proc.returncode != 0
    assert elapsed < JOB_LIMIT_S
    lines = watchdog_lines(proc.stderr)
    assert lines, proc.stderr[-4000:]
    # Every survivor names the lost rank; the store's host (rank 0) may die before its heartbeat shows the phase.
    expected = f"hpc_rlhf: rank {rank} (role {role}) {verb} during "
    assert all(line.startswith(expected) for line in lines), "\n".join(lines)
    if rank != 0:
        assert all(line.startswith(expected + f"{phase}: ") and f"[step {step};" in line for line in lines)
    # Nothing that was saved is lost: the checkpoints before the failure are complete.
    found = ckpt.latest_complete(out)
    assert (found[0] if found else 0) == step - 1


def test_non_finite_steps_are_skipped_by_the_whole_role_and_too_many_stop_the_run(model, tmp_path):
    out = tmp_path / "run"
    # The second actor rank's loss is NaN at step 2, and again from step 4 on; the first rank's stays finite.
    proc, _ = grpo(model, out, "kind=nan,rank=1,step=2;kind=nan,rank=1,step=4+",
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
