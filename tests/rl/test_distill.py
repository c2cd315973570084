"""On-policy distillation (distill.teacher, the placement's `teacher` role): the teacher scores every token the
actor samples and each token's advantage gains its per-token reverse-KL term (the arithmetic: tests/algorithms/
test_advantages.py). Here the runs end to end: the learning test (the SFT base distilling from the suite's GRPO-
trained model, against GRPO alone), the hybrid hf engine with multi-turn episodes and the teacher on the actor's
rank, and a LoRA student on vLLM with the teacher on a rank of its own, one step of staleness."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.utils.metrics import read_metrics
import pytest

from tests.distributed import hpc_rlhf_cli
from tests.recipes import QUIET, Curve, learning, record_figures

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"

# Both runs of the learning test: GRPO's settings (examples/tiny/grpo.yaml) with two samples per prompt, so that
# the reward's signal is sparse (a pair of equal scores gives no advantage) while the teacher scores every token.
# At GRPO's eight samples per prompt the teacher added too little to beat GRPO alone reliably at a fixed step:
# after 2 steps +0.013 to +0.073 on AMD (seeds 0-4, 2026-11-28) but -0.010 at Intel's seed 0, CI's seed
# (2026-11-30: `make test` failed there), and -0.017 to +0.020 at that seed for distill.coef 1-10 and 1-4 steps.
# Two samples of 16 prompts, 3 steps (Intel Xeon, 2026-11-30) held on Intel, 0.57-0.98 of the way to the teacher,
# but not on AMD (2026-12-01, seeds 0-4 each with its own SFT base and teacher): 0.49 of the way at seed 0, CI's
# seed (`make test` failed there), and +0.003 over GRPO alone at seed 2 (+0.003 at step 4 too, at most +0.010 in
# 6 steps). Two samples of 32 prompts, 4 steps (AMD, the same seeds): 0.73-1.08 of the way, +0.013 to +0.110 over
# GRPO alone, and the student ahead at every step 1-5 of every seed (docs/results.md). Intel: not yet calibrated.
DISTILL_RUN = ["rollout.prompts_per_step=32", "rollout.n_samples=2", "train.batch_size=64", "train.micro_batch_size=32",
               "eval.max_rows=300"]
DISTILL_STEPS = 4
DISTILL_MARGIN = 0.005  # the control gives 0; the smallest gain measured, +0.013, is 4 prompts of 300
# Of the way from the SFT base to the teacher, the half: the recipe reached 0.73-1.08 on AMD (seed 0:
# 0.73); the eight-sample recipe before it got 0.42 at AMD's seed 2, when the test asked a third.
TOWARDS_TEACHER = 0.5


@pytest.mark.learning
def test_distilling_an_rl_trained_teacher_beats_grpo_alone_at_the_same_step(tmp_path, sft_base, grpo_teacher):
    """The SFT base samples, GRPO's rule reward and the teacher's per-token reverse KL both in its advantages: after
    DISTILL_STEPS steps its held-out exact match is at least half of the way from the SFT base to the teacher,
    and above GRPO alone (the same run without the teacher) at the same step from the same start."""
    teacher = Curve(grpo_teacher.parent).end["eval_accuracy"]
    runs = {}
    for name, extra in (("grpo_alone", ["placement=actor+ref=1,rollout@actor"]),
                        ("student", [f"distill.teacher={grpo_teacher}", "placement=actor+ref+teacher=1,rollout@actor",
                                     "distill.coef=1.0"])):
        out = tmp_path / name
        hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={sft_base}",
                     *extra, *DISTILL_RUN, *learning(f"train.max_steps={DISTILL_STEPS}",
                                                    f"log.eval_every_steps={DISTILL_STEPS}"), *QUIET)
        runs[name] = Curve(out)
    sft, grpo_alone = runs["grpo_alone"].values("eval_accuracy")[0], runs["grpo_alone"].values("eval_accuracy")[-1]
    student = runs["student"]
    reached = student.values("eval_accuracy")[-1]
    record_figures("distill", sft=sft, teacher=teacher, grpo_alone=grpo_alone, student=reached,
                   teacher_kl=student.values("teacher_kl"))
    assert student.values("eval_accuracy")[0] == sft, "the two runs did not start from the same model"
    assert student.values("teacher_kl"), "the teacher scored no token"
    assert reached >= sft + TOWARDS_TEACHER * (teacher - sft), (
        f"student {reached} after {DISTILL_STEPS} steps, not half of the way from the SFT base {sft} to the teacher "
        f"{teacher}")
    assert reached >= grpo_alone + DISTILL_MARGIN, (f"student {reached} against GRPO alone {grpo_alone} at step "
                                                    f"{DISTILL_STEPS}")


SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples=4", "train.batch_size=16", "train.micro_batch_size=8",
         "train.lr=1e-3", "log.eval_every_steps=0", "checkpoint.every_steps=0", *QUIET]


def test_a_teacher_on_the_actors_rank_scores_the_model_tokens_of_episodes(tmp_path):
    """Hybrid hf engine, the teacher colocated with the actor and the reference, multi-turn episodes with no reward
    but the teacher's. A teacher equal to the student (the same folder) gives a reverse KL of exactly 0 and so no
    gradient: the student already is what it distils. Another teacher gives both."""
    rows = {}
    for name, teacher, steps in (("same", TINY_MODEL, 1), ("other", another_teacher(tmp_path / "teacher"), 2)):
        out = tmp_path / name
        hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                     f"distill.teacher={teacher}", "placement=actor+ref+teacher=1,rollout@actor",
                     "env.name=guess_number", "env.max_turns=3", "env.max_episode_tokens=24",
                     "rollout.max_new_tokens=4", "reward.functions=[]", f"train.max_steps={steps}", *SMALL)
        rows[name] = read_metrics(out)
    [same] = rows["same"]
    assert same["teacher_kl"] == 0 and same["actor_grad_norm"] == 0
    assert [r["step"] for r in rows["other"]] == [1, 2]
    assert all(r["teacher_kl"] > 0.01 and r["actor_grad_norm"] > 0 for r in rows["other"])
    assert all(r["episode_tokens_mean"] > 0 for r in rows["other"])


def another_teacher(folder: Path) -> Path:
    """The tiny model with its weights moved: a teacher that disagrees with the student from the first token."""
    shutil.copytree(TINY_MODEL, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    save_file({name: w + 0.05 * torch.randn(w.shape, generator=generator) for name, w in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_lora_student_on_vllm_distills_from_a_teacher_on_its_own_rank_one_step_stale(tmp_path):
    """The teacher alone as the signal (no reward function), on its own rank; the engine one step ahead. (A
    teacher equal to the student gives no signal at all: the student already is what it distils.)"""
    out = tmp_path / "disjoint"
    teacher = another_teacher(tmp_path / "teacher")
    hpc_rlhf_cli("grpo", "--config", "examples/tiny/grpo.yaml", f"output_dir={out}", f"actor.path={TINY_MODEL}",
                 f"distill.teacher={teacher}", "placement=actor=1,teacher=1,rollout=1", "reward.functions=[]",
                 "rl.kl_coef=0", "actor.lora.rank=8", "rollout.backend=vllm", "rollout.kv_cache_mb=64",
                 "rl.max_staleness=1", "train.max_steps=3", "rollout.max_new_tokens=6", *SMALL)
    rows = read_metrics(out)
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    assert all(math.isfinite(r["teacher_kl"]) for r in rows)
    assert all(r["teacher_kl"] > 0.01 for r in rows)  # the teacher disagrees, whatever the student samples
    assert all(r["actor_grad_norm"] > 0 for r in rows)
