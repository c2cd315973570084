"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Factor applied to the peak learning rate before optimizer step `step` (0-based).

    Warmup ramps linearly over the first `warmup_steps` steps and reaches the peak on step `warmup_steps - 1`
    (step 0 already trains, at 1/warmup_steps of the peak, instead of wasting a step at lr 0). The cosine then
    starts at the peak on step `warmup_steps`, reaches `min_lr_ratio` on step `max_steps` and stays there if
    training runs longer.
    """
    if warmup_steps < 0 or max_steps < 1:
        raise ValueError(f"warmup_cosine: need warmup_steps >= 0 and max_steps >= 1, got {warmup_steps}, {max_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                            min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `optimizer` following `warmup_cosine` (its lr at construction is the peak)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, max_steps, min_lr_ratio))
