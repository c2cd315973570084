"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
a prompt whose n samples all got the same reward has advantage 0 under every group estimator (GRPO, Dr. GRPO,
RLOO), so it adds nothing to the gradient but still counts in the batch's mean; DAPO drops such groups and
fills the batch with groups from further generation rounds.

Scores are (num_prompts * n,) in prompt-major order: sample i of prompt p at index p * n + i, as everywhere in
`advantages`. Everything here is a pure function of tensors and counts; which prompts a round generates and
when to stop generating are the recipe's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def uniform_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """(num_prompts,) bool: True where all n samples of the prompt got exactly the same score.

    Equality is exact, on purpose: equal scores are the groups whose advantage is 0 by definition under every
    group estimator, the case DAPO drops. A tolerance would have no natural scale (scores are whatever the reward
    functions and models return) and would drop groups whose scores really differ. Equal outcomes give equal
    floats, as the same arithmetic runs on the same inputs. Deciding on the computed advantages instead would not
    do: the float32 mean of n equal scores can be off by rounding, and GRPO's division by the group's std (then
    as small as that rounding) can blow it up to a visible advantage (16 scores of 0.7 gave |A| = 0.056 on CPU).
    Filter on the task's score, before any KL penalty or length shaping enters it: DAPO filters on the outcome.
    """
    if n < 2:
        raise ValueError(f"n (samples per prompt) must be >= 2 for dynamic sampling, got {n}")
    if scores.dim() != 1 or scores.numel() % n:
        raise ValueError(f"scores must be (num_prompts * {n},) for n={n} samples per prompt, got shape "
                         f"{tuple(scores.shape)}")
    bad = (~torch.isfinite(scores)).nonzero()
    if len(bad):
        index = int(bad[0])
        raise ValueError(f"scores must be finite, got {scores[index].item()} at sample {index}")
    groups = scores.detach().view(-1, n)
    return (groups == groups[:, :1]).all(-1)


def fill_batch(kept_per_round: Sequence[torch.Tensor], groups_wanted: int) -> list[torch.Tensor]:
    """Which groups fill the batch: the first `groups_wanted` kept groups, in round order, then prompt order.

    kept_per_round: one (num_prompts_r,) bool tensor per generation round (the complement of `uniform_groups`),
    rounds in the order they were generated. Returns one bool tensor of the same shape per round: the groups
    chosen. Deterministic, and a prefix of what a longer run would choose: a group generated earlier is never
    passed over for a later one, so a round only has to be generated while the batch is not full. With fewer
    kept groups than wanted, every kept group is chosen (the recipe trains on what there is and logs it).
    """
    if groups_wanted < 0:
        raise ValueError(f"groups_wanted must be >= 0, got {groups_wanted}")
    chosen, still_wanted = [], groups_wanted
    for round_index, kept in enumerate(kept_per_round):
        if kept.dim() != 1:
            raise ValueError(f"kept_per_round[{round_index}] must be (num_prompts,), got shape {tuple(kept.shape)}")
        kept = kept != 0
        # The k-th kept group of this round (1-based) is taken while k <= the groups still wanted.
        take = kept & (torch.cumsum(kept.long(), 0) <= still_wanted)
        chosen.append(take)
        still_wanted -= int(take.sum())
    return chosen


def dynamic_sampling_figures(kept_per_round: Sequence[torch.Tensor], chosen_per_round: Sequence[torch.Tensor],
                             n: int) -> dict[str, float]:
    """The metrics of one step's dynamic sampling:

        groups_filtered_share           groups with uniform scores / groups generated, over all rounds
        generation_rounds               rounds generated
        extra_samples_per_trained       (samples generated - samples trained) / samples trained; with nothing
                                        trained, the samples generated (the denominator taken as 1)
    """
    if len(kept_per_round) != len(chosen_per_round):
        raise ValueError(f"kept_per_round has {len(kept_per_round)} rounds but chosen_per_round "
                         f"{len(chosen_per_round)}")
    generated = sum(int(kept.numel()) for kept in kept_per_round)
    filtered = sum(int((kept == 0).sum()) for kept in kept_per_round)
    trained = sum(int((chosen != 0).sum()) for chosen in chosen_per_round)
    return {"groups_filtered_share": filtered / max(generated, 1),
            "generation_rounds": float(len(kept_per_round)),
            "extra_samples_per_trained": (generated - trained) * n / max(trained * n, 1)}
