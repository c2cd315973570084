"""DAPO's handling of answers that run into the length limit (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale"): a soft length penalty added to the reward, and the overlong filter,
which drops answers cut by the limit from the loss (their reward judges an unfinished answer, not its reasoning).

Lengths are (batch,) counts of response tokens, the stop token included when the engine stopped on one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def overlong_penalty(response_lens: torch.Tensor, max_new_tokens: int, overlong_buffer: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, to add to each answer's reward. With L = |y|, L_max = max_new_tokens,
    L_cache = overlong_buffer:

        R_length(y) = 0                                      L <= L_max - L_cache
                      ((L_max - L_cache) - L) / L_cache      L_max - L_cache < L <= L_max
                      -1                                     L > L_max

    times `penalty_factor`: the penalty falls linearly from 0 to -penalty_factor over the last L_cache tokens
    the engine may generate (continuous at both ends). (batch,) -> (batch,) float32.
    """
    if max_new_tokens < 1 or not 0 < overlong_buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer must be in [1, max_new_tokens={max_new_tokens}], got {overlong_buffer}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if response_lens.dim() != 1:
        raise ValueError(f"response_lens must be (batch,), got shape {tuple(response_lens.shape)}")
    lengths = response_lens.detach().to(torch.float32)
    expected = max_new_tokens - overlong_buffer
    in_buffer = (expected - lengths) / overlong_buffer
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths),
                          torch.where(lengths <= max_new_tokens, in_buffer, torch.full_like(lengths, -1.0)))
    return penalty * penalty_factor


def truncated_responses(response_lens: torch.Tensor, last_tokens: torch.Tensor, stop_ids: Iterable[int],
                        max_new_tokens: int) -> torch.Tensor:
    """(batch,) bool: the answers cut by the length limit, i.e. max_new_tokens long and not ending with a stop
    token (an answer that stops exactly at the limit is complete). last_tokens (batch,): each answer's last
    token id (any value for an empty answer). The overlong filter drops these from the loss:
    `losses.loss_mask(action_mask, keep_sequences=~truncated)`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if response_lens.dim() != 1 or last_tokens.shape != response_lens.shape:
        raise ValueError(f"response_lens and last_tokens must both be (batch,), got {tuple(response_lens.shape)} "
                         f"and {tuple(last_tokens.shape)}")
    too_long = (response_lens > max_new_tokens).nonzero()
    if len(too_long):
        index = int(too_long[0])
        raise ValueError(f"response {index} has {int(response_lens[index])} tokens, more than "
                         f"max_new_tokens={max_new_tokens}")
    stops = torch.tensor(sorted(set(int(t) for t in stop_ids)), dtype=last_tokens.dtype, device=last_tokens.device)
    return (response_lens == max_new_tokens) & ~torch.isin(last_tokens, stops)


def truncated_share(truncated: torch.Tensor) -> torch.Tensor:
    """The share of answers that hit the length limit (the metric `truncated_share`): 0 for an empty batch."""
    return truncated.float().sum() / max(truncated.numel(), 1)
