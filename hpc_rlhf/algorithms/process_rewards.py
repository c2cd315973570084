"""A process reward model's scores in RL: the probability it gives each step of a response, and one reward per
response from them.

A process reward model (`hpc-rlhf prm`) reads a solution with a marker token after each step; at a marker, its
next-token distribution over the reward tokens ("+", "-") says whether the steps so far are right. The score of a
step is the probability of the first reward token there, the softmax of the reward tokens' logits alone (what the
model was trained on, algorithms.losses.process_reward_loss). A response's reward aggregates its steps' scores
(choices.STEP_AGGREGATIONS); a response without a marker has no step to score and gets NO_STEP_REWARD, the lowest
a step's probability can be, so that a policy cannot escape the judge by writing no steps.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.choices import STEP_AGGREGATIONS

NO_STEP_REWARD = 0.0


def step_probabilities(marker_logits: torch.Tensor) -> torch.Tensor:
    """(N, K) reward tokens' logits at N markers -> (N,) float32 probability of the first reward token at each."""
    return torch.softmax(marker_logits.float(), dim=-1)[:, 0]


def aggregate_steps(step_scores: list[torch.Tensor], how: str) -> torch.Tensor:
    """One reward per response, (B,) float32, from each response's steps' scores (a 1-D tensor each, in order;
    empty for a response without a marker, which gets NO_STEP_REWARD)."""
    if how not in STEP_AGGREGATIONS:
        raise ValueError(f"step aggregation must be one of {STEP_AGGREGATIONS}, got {how!r}")
    out = torch.full((len(step_scores),), NO_STEP_REWARD, dtype=torch.float32)
    for i, scores in enumerate(step_scores):
        if scores.numel() == 0:
            continue
        scores = scores.float()
        if how == "min":
            out[i] = scores.min()
        elif how == "product":
            out[i] = scores.prod()
        elif how == "last":
            out[i] = scores[-1]
        else:
            out[i] = scores.mean()
    return out
