"""The shared pieces of the one-model recipes (sft, rm, dpo, kto): when a step logs and evaluates, which rows a
rank trains on, the figures every mode logs, and the first and last steps of training."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpc_rlhf.engines.train import StepInfo
from hpc_rlhf.trainers import checkpointing
from hpc_rlhf.trainers import loop
from hpc_rlhf.data import order
from hpc_rlhf.trainers import run as run_setup
from hpc_rlhf.utils import checkpoint as ckpt
from hpc_rlhf.utils.metrics import MetricsLogger, read_metrics
from tests.recipes import one_rank_world, sft_config


def a_run(out: Path, *overrides: str, rank: int = 0, world_size: int = 1, start_step: int = 0) -> run_setup.Run:
    return run_setup.Run(cfg=sft_config(out, *overrides), mode="sft", output_dir=out, rank=rank,
                      world_size=world_size, device=None, start_step=start_step)


class FakeEngine:
    """What start_training and finish_training ask of a TrainEngine (and of the logger), recorded."""

    def __init__(self):
        self.calls = []

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.calls.append(("save_checkpoint", Path(path)))

    def load_checkpoint(self, path):
        self.calls.append(("load_checkpoint", Path(path)))

    def save_hf(self, directory, tokenizer=None):
        self.calls.append(("save_hf", Path(directory), tokenizer))

    def close(self):  # as the run's logger
        self.calls.append(("close",))


def test_log_and_eval_steps(tmp_path):
    cfg = sft_config(tmp_path, "train.max_steps=10", "log.every_steps=4", "log.eval_every_steps=6")
    assert [s for s in range(1, 11) if run_setup.log_due(cfg, s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if run_setup.eval_due(cfg, s)] == [6, 10]
    cfg.log.eval_every_steps = 0  # only at the end
    assert [s for s in range(1, 11) if run_setup.eval_due(cfg, s)] == [10]


def test_eval_before_training_only_on_a_fresh_run(tmp_path):
    assert run_setup.eval_before_training(a_run(tmp_path, "log.eval_every_steps=5"))
    assert not run_setup.eval_before_training(a_run(tmp_path, "log.eval_every_steps=5", start_step=3))
    assert not run_setup.eval_before_training(a_run(tmp_path, "log.eval_every_steps=0"))


def test_step_micro_batches_share_the_step_between_ranks(tmp_path):
    settings = ("train.batch_size=8", "train.micro_batch_size=2", "train.seed=7")
    ranks = [loop.step_micro_batches(a_run(tmp_path, *settings, rank=r, world_size=2), 20, 3) for r in (0, 1)]
    assert all(len(micro) == 2 and all(len(m) == 2 for m in micro) for micro in ranks)
    rows = [i for micro in ranks for m in micro for i in m]
    assert rows == order.step_indices(20, 8, 3, 7)
    assert loop.step_micro_batches(a_run(tmp_path, *settings, rank=0, world_size=2), 20, 4) != ranks[0]


def test_step_figures():
    guard = checkpointing.NonFiniteGuard(max_in_a_row=5)
    guard.update(True, 1)
    guard.update(False, 2)
    figures = run_setup.step_figures(StepInfo(stepped=True, grad_norm=0.5, lr=1e-3), 1000, 4.0, guard)
    assert figures == {"lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 250.0, "skipped_steps": 1}
    assert list(figures) == ["lr", "grad_norm", "tokens_per_s", "skipped_steps"]  # the order of metrics.jsonl
    assert math.isfinite(run_setup.step_figures(StepInfo(True, None, 0.0), 10, 0.0, guard)["tokens_per_s"])


def test_window_means_leave_out_non_finite_values():
    one_rank_world()
    means = run_setup.window_means({"loss": [1.0, 3.0, float("nan")], "margin": []})
    assert means["loss"] == pytest.approx(2.0) and math.isnan(means["margin"])
    assert list(means) == ["loss", "margin"]


def test_start_training_resumes_before_opening_the_logger(tmp_path):
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true", "train.max_steps=10", "train.max_bad_steps=4")
    engine = FakeEngine()
    checkpointing.save_checkpoint(run, 3, {"model": engine})
    old = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    for step in range(1, 6):  # rows of steps 4 and 5 belong to work the resumed run redoes
        old.log(step, {"loss": float(step)})
    old.close()

    bad_steps, stop = loop.start_training(run, {"model": engine})
    assert run.start_step == 3
    assert engine.calls[-1] == ("load_checkpoint", ckpt.checkpoints_root(tmp_path) / ckpt.checkpoint_name(3) / "model")
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    assert isinstance(stop, checkpointing.StopSignal) and not stop.requested()
    assert (bad_steps.what, bad_steps.max_in_a_row, bad_steps.total) == ("sft", 4, 0)
    run.logger.log(4, {"loss": 0.5})
    run.logger.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_finish_training_saves_final_and_closes_the_logger(tmp_path):
    one_rank_world()
    run = a_run(tmp_path)
    engine = FakeEngine()
    run.logger = engine  # records close()
    loop.finish_training(run, engine, tokenizer="the tokenizer")
    assert engine.calls == [("save_hf", tmp_path / "final", "the tokenizer"), ("close",)]



def test_mean_and_std_keep_the_spread_of_large_scores():
    """Reward-model scores of 100 +- 0.01: the one-pass E[x^2] - E[x]^2 in float32 loses the spread entirely
    (normalised rewards then come out ~10^4 too large); two passes in float64 keep it."""
    one_rank_world()
    scores = torch.tensor([100.01, 99.99] * 50, dtype=torch.float32)
    mean, std = run_setup.mean_and_std(scores)
    assert mean == pytest.approx(100.0, abs=1e-4)
    assert std == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(ValueError, match="no values"):
        run_setup.mean_and_std(torch.zeros(0))


def test_what_a_recipe_saves_beside_its_engines_is_sealed_in_the_same_checkpoint(tmp_path):
    """`save_extra` (the RL recipe's batches in flight) writes into the staging folder and adds trainer-state
    entries: both are part of the committed, verified checkpoint, and resuming says where it was."""
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true")

    def save_extra(staging: Path) -> dict:
        (staging / "rollout").mkdir()
        torch.save({"tokens": torch.arange(5)}, staging / "rollout" / "engine000.pt")
        return {"in_flight": {"7": 6}}

    final = checkpointing.save_checkpoint(run, 6, {"model": FakeEngine()}, save_extra=save_extra)
    assert ckpt.verify(final) is None
    assert "rollout/engine000.pt" in json.loads((final / ckpt.MARKER).read_text())["files"]
    state = checkpointing.resume_if_possible(run, {"model": FakeEngine()})
    assert state["in_flight"] == {"7": 6} and state["step"] == 6
    assert run.extra["resumed_from"] == final
