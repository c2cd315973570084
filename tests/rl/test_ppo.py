"""The RL modes end to end on the built-in task, through the command line and the local launcher.

The learning tests start from an SFT model trained on demonstrations with a systematic carry mistake
(DESIGN §7), so imitation plateaus; GRPO (colocated) with the exact-match rule reward, and PPO (critic, GAE, all
five roles on six ranks) with a learned reward model alone, must then raise held-out exact match clearly, with
the KL to the SFT model bounded. Several reward models and a rule are combined with weights, checked exactly.
"""

from __future__ import annotations

import shutil

import pytest

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.launch.local import PREEMPTED_EXIT_CODE
from hpc_rlhf.utils.faults import FAULT_ENV
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import hpc_rlhf_cli
from tests.recipes import QUIET, Curve, assert_rl_beats_the_plateau, learning

EVAL_ROWS = "eval.max_rows=300"
TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"  # the built-in random model, for the tests of mechanics
hpc_rlhf = hpc_rlhf_cli


@pytest.mark.learning
def test_grpo_rule_reward_beats_the_sft_plateau_colocated(grpo_teacher):
    """The shared run tests/recipes.py trains as the distillation test's teacher (GRPO_TEACHER): 30 steps of GRPO
    with the exact-match rule, colocated, from the SFT base."""
    out = grpo_teacher.parent
    assert_rl_beats_the_plateau("grpo", out, GAIN, MAX_KL)
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.learning
def test_ppo_with_a_reward_model_beats_the_sft_plateau_on_six_ranks(tmp_path, sft_base, ppo_reward_model):
    """All five roles on their own ranks (actor, critic, ref, reward, two rollout engines), rewarded by the
    learned reward model alone: held-out exact match rises, and every figure of the step is logged."""
    rm_accuracy = Curve(ppo_reward_model.parent).end["eval_accuracy"]
    out = tmp_path / "ppo6"
    hpc_rlhf("ppo", "--config", "examples/tiny/ppo.yaml", f"output_dir={out}", f"actor.path={sft_base}",
             f"critic.path={ppo_reward_model}", f"reward.models=[{ppo_reward_model}]", "reward.functions=[]",
             *learning("train.max_steps=40", "log.eval_every_steps=20", f"rl.kl_coef={RM_PPO_KL}"), EVAL_ROWS, *QUIET)
    assert rm_accuracy >= RM_ACCURACY, "the reward model this test relies on ranks held-out pairs badly"
    rows = assert_rl_beats_the_plateau("ppo_rm", out, RM_PPO_GAIN, MAX_KL, rm_accuracy=rm_accuracy).rows
    for key in ("reward", "kl_k1", "entropy", "policy_loss", "value_loss", "clip_fraction", "value_clip_fraction",
                "response_length", "time_generate", "time_score", "time_train", "time_sync", "samples_per_s",
                "weight_sync_mb"):
        assert key in rows[-1], key
    assert rows[-1]["weight_sync_mb"] > 0
    assert (out / "final" / "model.safetensors").is_file() and (out / "final_critic" / "model.safetensors").is_file()


# The 2-layer tiny Llama (2026-11-28, seeds 0-4 and the control; docs/results.md): SFT bases 0.58-0.70, GRPO
# +0.173 to +0.317; reward models of 2,000 steps 0.928-0.992, PPO with one alone (KL coefficient RM_PPO_KL) +0.253,
# +0.150, +0.177, +0.123, +0.240 (max KL 0.68-1.09); with train.lr=0 the gains are 0. Judges that score each pair in
# one row (rm.share_prompt, 2026-11-29): +0.257, +0.200, +0.153, +0.187, +0.257. The 4-layer model's figures:
# Calibrated over seeds 0-4 (300 held-out prompts; scripts/calibrate_learning_tests.py, docs/results.md): the session's SFT
# base scores 0.62-0.80 (its carry problems are the demonstrations' mistake). GRPO gained +0.15 to +0.24 in 30
# steps. The reward model reached 0.914-0.976 held-out pairwise accuracy, and PPO with it alone gained +0.09 to
# +0.22 in 40 steps (max KL 0.8-1.3); before the critic's head was put in normalised units
# (models/value_model.fold_reward_normalization) the same runs went -0.16 to +0.22. With train.lr=0 the gains
# are 0.
GAIN = 0.08
RM_PPO_GAIN = 0.05
# The 2-layer judge ranks an answer one too large above the right one in about 40% of prompts (a probe of 300 at
# seed 3); at examples/tiny/ppo.yaml's KL coefficient, 0.02, PPO learned those near misses at seed 3 (exact match
# -0.127 against a 1,000-step judge, +0.047 against a 2,000-step one). A stronger pull to the reference keeps the
# policy near what it can already do: 0.1 gave +0.124 at seed 3 (0.05: +0.090; 2026-11-28, docs/results.md).
RM_PPO_KL = 0.1
RM_ACCURACY = 0.85
MAX_KL = 5.0


def test_two_reward_models_and_a_rule_reward_are_summed_with_weights(tmp_path):
    """Two reward-model roles plus a rule function, under ZeRO-3: step 1 draws the same samples whatever the
    weights, so two runs that differ only in the rule's weight differ in mean reward by exactly that weight.
    (Mechanics only: the built-in random tiny model serves as actor and, with a new seeded head, as both reward
    models, so this test does not wait for the session's SFT base.)"""
    rule = tmp_path / "rule.py"
    rule.write_text("def one(prompts, responses, answers):\n    return [1.0] * len(responses)\n")
    rewards = {}
    for weight in (0.0, 3.0):
        out = tmp_path / f"w{weight}"
        hpc_rlhf("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                 "placement=actor+ref=1,reward=1,reward2=1,rollout@actor",
                 f"reward.models=[{TINY_MODEL},{TINY_MODEL}]", "reward.model_weights=[0.5,0.25]",
                 f"reward.functions=[{rule}:one]", f"reward.function_weights=[{weight}]", "train.max_steps=1",
                 "train.zero_stage=3",  # frozen reward models sharded, hybrid generation on gathered weights
                 "log.eval_every_steps=0", *QUIET)
        rewards[weight] = read_metrics(out)[0]["reward"]
    assert rewards[3.0] - rewards[0.0] == pytest.approx(3.0, abs=1e-4)


def test_broken_reward_function_stops_with_its_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(prompts, responses, answers):\n    return [1.0]\n")
    proc = hpc_rlhf("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={tmp_path}/bad",
                    f"actor.path={TINY_MODEL}", "placement=actor+ref=1,rollout@actor",
                    f"reward.functions=[{bad}:f]", "train.max_steps=2", "log.eval_every_steps=0", *QUIET,
                    check=False)
    assert proc.returncode != 0
    assert f"reward function '{bad}:f' returned 1 rewards for 128 responses" in proc.stderr


def test_seeded_runs_repeat_and_resume_exactly(tmp_path):
    """Disjoint GRPO (actor, ref, two engines): a run stopped by a stop signal during step 2, an evaluation step,
    writes its checkpoint without evaluating and exits for its requeue; restarted, it evaluates the checkpointed
    actor first and repeats the uninterrupted run's evaluations and steps 3 and 4 exactly (same seed: same samples,
    same updates)."""
    common = ["--config", "examples/tiny/grpo.yaml", f"actor.path={TINY_MODEL}", "rollout.prompts_per_step=8",
              "train.batch_size=32", "log.eval_every_steps=2", "eval.max_rows=8", "checkpoint.every_steps=0",
              "train.max_steps=4", *QUIET]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    hpc_rlhf("grpo", *common, f"output_dir={full}")
    stopped = hpc_rlhf("grpo", *common, f"output_dir={resumed}", check=False,
                       env={FAULT_ENV: "rank=0,kind=stop,phase=training,step=2"})  # Slurm's --signal, in step 2
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-4000:]
    assert [(r["step"], "eval_accuracy" in r) for r in read_metrics(resumed)] == [(0, True), (1, False), (2, False)]
    hpc_rlhf("grpo", *common, f"output_dir={resumed}")

    def figures(out):
        keep = ("reward", "kl_k1", "kl_k3", "policy_loss", "entropy", "response_length", "actor_grad_norm")
        return [{k: r[k] for k in keep if k in r} for r in read_metrics(out) if "reward" in r]

    def evaluations(out):
        return [(r["step"], r["eval_accuracy"]) for r in read_metrics(out) if "eval_accuracy" in r]

    assert [r["step"] for r in read_metrics(resumed)] == [0, 1, 2, 2, 3, 4]  # step 2's evaluation in a row of its own
    assert evaluations(full) == evaluations(resumed) and [s for s, _ in evaluations(full)] == [0, 2, 4]
    assert figures(full) == figures(resumed)
    assert figures(full)[2] != figures(full)[3]  # the steps differ: equality is not trivial


def test_a_six_rank_zero3_ppo_resumes_on_fewer_and_on_more_ranks(tmp_path):
    """PPO (actor 2, critic 2, ref 1, one engine; ZeRO-3 for both trained models) checkpoints after step 1; the same
    folder resumed with actor 1 + critic 1 (4 ranks) and with actor 3 + critic 3 (8 ranks) reshards both models'
    optimizer states (issue 36): steps 2-3 follow the uninterrupted run's up to the order of the sums. Step 3's
    figures come after a resumed Adam update, so a reset optimizer state would show there."""
    common = ["--config", "examples/tiny/ppo.yaml", f"actor.path={TINY_MODEL}", f"critic.path={TINY_MODEL}",
              "reward.models=[]", "reward.functions=[exact_match]", "train.zero_stage=3",
              "critic_train.zero_stage=3", "rollout.prompts_per_step=6", "rollout.n_samples=2",
              "train.batch_size=12", "train.micro_batch_size=2", "critic_train.batch_size=12",
              "critic_train.micro_batch_size=2", "train.lr=1e-3", "critic_train.lr=1e-3", "train.max_steps=3",
              "log.eval_every_steps=0", "checkpoint.every_steps=1", "checkpoint.keep=3", *QUIET]
    full = tmp_path / "full"
    hpc_rlhf("ppo", *common, f"output_dir={full}", "placement=actor=2,critic=2,ref=1,rollout=1")
    keep = ("reward", "kl_k1", "policy_loss", "actor_grad_norm", "value_loss", "critic_grad_norm")
    expected = {r["step"]: r for r in read_metrics(full)}
    # ZeRO-3 trains as ZeRO-0 does: step 1 (the same samples) on one rank per model without ZeRO. The critic's
    # forward once bypassed DeepSpeed's engine, which under ZeRO-3 gave a gradient norm of 0.86 against 30.7.
    zero0 = tmp_path / "zero0"
    hpc_rlhf("ppo", *common, f"output_dir={zero0}", "placement=actor=1,critic=1,ref=1,rollout=1", "train.max_steps=1",
             "train.zero_stage=0", "critic_train.zero_stage=0", "checkpoint.every_steps=0")
    [first] = read_metrics(zero0)
    for key in keep:
        assert first[key] == pytest.approx(expected[1][key], rel=1e-4, abs=1e-6), key
    for name, placement in (("fewer", "actor=1,critic=1,ref=1,rollout=1"),
                            ("more", "actor=3,critic=3,ref=1,rollout=1")):
        out = tmp_path / name
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints" / "step_000000001", out / "checkpoints" / "step_000000001")
        proc = hpc_rlhf("ppo", *common, f"output_dir={out}", f"placement={placement}")
        ranks = sum(int(part.split("=")[1]) for part in placement.split(","))
        assert f"resumed step 1 written by 6 ranks on {ranks}" in proc.stdout + proc.stderr
        got = {r["step"]: r for r in read_metrics(out)}
        assert sorted(got) == [2, 3]
        for step in (2, 3):
            for key in keep:
                assert got[step][key] == pytest.approx(expected[step][key], rel=1e-3, abs=1e-5), (name, step, key)
