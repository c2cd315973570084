"""On-policy distillation (distill.teacher, the placement's `teacher` role): the teacher scores every token the
actor samples and each token's advantage gains its per-token reverse-KL term (the arithmetic: tests/algorithms/
test_advantages.py). Here the runs end to end: the hybrid hf engine with multi-turn episodes and the teacher on the
actor's rank, and a LoRA student on vLLM with the teacher on a rank of its own, one step of staleness."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import hpc_rlhf_cli
from tests.recipes import QUIET

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"
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
