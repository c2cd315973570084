"""What every recipe does first and logs by (hpc_rlhf/runtime/run.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_rlhf.runtime import run as run_setup
from tests.recipes import a_run, one_rank_world, sft_config


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


def test_window_means_leave_out_non_finite_values():
    one_rank_world()
    means = run_setup.window_means({"loss": [1.0, 3.0, float("nan")], "margin": []})
    assert means["loss"] == pytest.approx(2.0) and math.isnan(means["margin"])
    assert list(means) == ["loss", "margin"]


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


