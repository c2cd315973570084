"""hpc_rlhf/algorithms/process_rewards.py: a step's score is the first reward token's share of the reward tokens'
softmax at its marker; a response's reward aggregates its steps, by hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_rlhf.algorithms.process_rewards import NO_STEP_REWARD, aggregate_steps, step_probabilities


def test_a_steps_score_is_the_first_reward_tokens_probability_among_the_reward_tokens():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(4.0)], [1.0, 1.0 + math.log(2.0)]])
    assert step_probabilities(logits).tolist() == pytest.approx([0.5, 0.75, 0.2, 1 / 3])
    # three reward tokens: the first against both others
    assert step_probabilities(torch.tensor([[math.log(2.0), 0.0, 0.0]])).tolist() == pytest.approx([0.5])


@pytest.mark.parametrize("how, expected", [("min", 0.2), ("product", 0.9 * 0.2 * 0.8), ("last", 0.8),
                                           ("mean", (0.9 + 0.2 + 0.8) / 3)])
def test_the_aggregations_of_three_steps(how, expected):
    steps = [torch.tensor([0.9, 0.2, 0.8]), torch.tensor([0.6]), torch.tensor([])]
    rewards = aggregate_steps(steps, how)
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    assert rewards.tolist() == pytest.approx([expected, 0.6, NO_STEP_REWARD])


def test_a_response_without_steps_gets_the_lowest_score_and_a_bad_name_is_refused():
    assert NO_STEP_REWARD == 0.0
    with pytest.raises(ValueError, match="step aggregation must be one of .*'geomean'"):
        aggregate_steps([torch.tensor([0.5])], "geomean")
