"""The RL modes end to end on the built-in task, through the command line and the local launcher.

The learning tests start from an SFT model trained on demonstrations with a systematic carry mistake
(DESIGN §7), so imitation plateaus; RL with a rule reward or a reward model trained on correct preferences
must then raise held-out exact match clearly, with the KL to the SFT model bounded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_rlhf.trainers.ppo import combine_scores
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import REPO, worker_env

QUIET = ["log.progress=false", "log.tensorboard=false"]
# An SFT base strong enough at plain addition that the carry mistake is what holds it back (DESIGN §7).
SFT_BASE = ["train.max_steps=800", "train.batch_size=128", "train.micro_batch_size=128", "train.lr=2e-3",
            "train.warmup_steps=20", "log.every_steps=100", "log.eval_every_steps=0", "eval.max_rows=300",
            "checkpoint.resume=false"]
RM_BASE = ["train.max_steps=300", "log.every_steps=100", "log.eval_every_steps=0", "checkpoint.resume=false"]
EVAL_ROWS = "eval.max_rows=300"


def hpc_rlhf(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf", *args], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpc-rlhf {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def eval_curve(out: Path) -> list[float]:
    return [r["eval_accuracy"] for r in read_metrics(out) if isinstance(r.get("eval_accuracy"), float)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """SFT on the imperfect demonstrations, then a reward model on correct-vs-wrong pairs from it."""
    root = tmp_path_factory.mktemp("rl")
    hpc_rlhf("sft", "--config", "examples/tiny/sft.yaml", f"output_dir={root}/sft", *QUIET, *SFT_BASE)
    hpc_rlhf("rm", "--config", "examples/tiny/rm.yaml", f"output_dir={root}/rm", f"model.path={root}/sft/final",
             *QUIET, *RM_BASE)
    return root


def test_grpo_rule_reward_beats_the_sft_plateau_colocated(base):
    out = base / "grpo"
    hpc_rlhf("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={base}/sft/final",
             "placement=actor+ref=1,rollout@actor", "train.max_steps=100", "log.eval_every_steps=50", EVAL_ROWS,
             *QUIET)
    curve = eval_curve(out)
    rows = read_metrics(out)
    assert curve[-1] >= curve[0] + GAIN, f"GRPO held-out exact match {curve} (from the SFT model at {curve[0]})"
    assert max(r["kl"] for r in rows if "kl" in r) < MAX_KL
    assert (out / "final" / "model.safetensors").is_file()


def test_ppo_reward_model_beats_the_sft_plateau_disjoint(base):
    """All five roles on their own ranks: actor, critic, ref, reward, and two rollout engines (6 ranks)."""
    out = base / "ppo"
    hpc_rlhf("ppo", "--config", "examples/tiny/ppo.yaml", f"output_dir={out}", f"actor.path={base}/sft/final",
             f"critic.path={base}/rm/final", f"reward.models=[{base}/rm/final]", "train.max_steps=100",
             "log.eval_every_steps=50", EVAL_ROWS, *QUIET)
    curve = eval_curve(out)
    rows = read_metrics(out)
    assert curve[-1] >= curve[0] + GAIN, f"PPO held-out exact match {curve} (from the SFT model at {curve[0]})"
    assert max(r["kl"] for r in rows if "kl" in r) < MAX_KL
    for key in ("reward", "kl", "entropy", "policy_loss", "value_loss", "clip_fraction", "value_clip_fraction",
                "response_length", "time_generate", "time_score", "time_train", "time_sync", "samples_per_s"):
        assert key in rows[-1], key
    assert (out / "final").is_dir() and (out / "final_critic").is_dir()


# Measured on the 2-core CI machine (see the issue note): the SFT base scores ~0.4, RL reaches ~0.55-0.65 in
# 100 steps. A gain of 0.1 is about 3 standard errors of a 300-prompt evaluation.
GAIN = 0.1
MAX_KL = 5.0


def test_combine_scores_weights_each_source():
    rule = torch.tensor([1.0, 0.0, 0.5])
    rm1, rm2 = torch.tensor([0.2, 0.4, -1.0]), torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(combine_scores(rule, [rm1, rm2], [2.0, -1.0]), torch.tensor([0.4, -1.2, -4.5]))
    with pytest.raises(ValueError):
        combine_scores(rule, [rm1, rm2], [1.0])


def test_two_reward_models_and_a_rule_reward_are_summed_with_weights(base, tmp_path):
    """Two reward-model roles plus a rule function, under ZeRO-3: step 1 draws the same samples whatever the
    weights, so two runs that differ only in the rule's weight differ in mean reward by exactly that weight."""
    rule = tmp_path / "rule.py"
    rule.write_text("def one(prompts, responses, answers):\n    return [1.0] * len(responses)\n")
    rewards = {}
    for weight in (0.0, 3.0):
        out = tmp_path / f"w{weight}"
        hpc_rlhf("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={base}/sft/final",
                 "placement=actor+ref=1,reward=1,reward2=1,rollout@actor",
                 f"reward.models=[{base}/rm/final,{base}/rm/final]", "reward.model_weights=[0.5,0.25]",
                 f"reward.functions=[{rule}:one]", f"reward.function_weights=[{weight}]", "train.max_steps=1",
                 "train.zero_stage=3",  # frozen reward models sharded, hybrid generation on gathered weights
                 "log.eval_every_steps=0", *QUIET)
        rewards[weight] = read_metrics(out)[0]["reward"]
    assert rewards[3.0] - rewards[0.0] == pytest.approx(3.0, abs=1e-4)


def test_broken_reward_function_stops_with_its_name(base, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(prompts, responses, answers):\n    return [1.0]\n")
    proc = hpc_rlhf("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={tmp_path}/bad",
                    f"actor.path={base}/sft/final", "placement=actor+ref=1,rollout@actor",
                    f"reward.functions=[{bad}:f]", "train.max_steps=2", "log.eval_every_steps=0", *QUIET,
                    check=False)
    assert proc.returncode != 0
    assert f"reward function '{bad}:f' returned 1 rewards for 128 responses" in proc.stderr


def test_seeded_runs_repeat_and_resume_exactly(base, tmp_path):
    """Disjoint GRPO (actor, ref, two engines): the same seed gives the same metrics, and a run stopped at a
    checkpoint and resumed continues exactly as the uninterrupted run."""
    common = ["--config", "examples/tiny/grpo.yaml", f"actor.path={base}/sft/final", "rollout.prompts_per_step=8",
              "train.batch_size=32", "log.eval_every_steps=0", "checkpoint.every_steps=2", *QUIET]
    full, split = tmp_path / "full", tmp_path / "split"
    hpc_rlhf("grpo", *common, f"output_dir={full}", "train.max_steps=4")
    hpc_rlhf("grpo", *common, f"output_dir={split}", "train.max_steps=2")
    hpc_rlhf("grpo", *common, f"output_dir={split}", "train.max_steps=4")

    def figures(out):
        keep = ("reward", "kl", "policy_loss", "entropy", "response_length", "actor_grad_norm")
        return [{k: r[k] for k in keep if k in r} for r in read_metrics(out)]

    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3, 4]
    assert figures(full) == figures(split)
