"""Process reward models as scorers of responses: a folder `hpc-rlhf prm` wrote, in the RL recipes'
`reward.models` or the `score.reward_models` of generate, rs, idpo and csft, beside (or instead of) outcome reward
models.

Such a folder is a causal LM whose config.json records `process_reward`: the marker token written after each step
and the reward tokens ("+" first). A scorer recognises it by that record and scores each response by its steps:
every marker in the response (in RL, among the tokens the policy generated: an environment's observations are not
the policy's steps) is a step, its score the probability of the first reward token there, and the response's
reward their aggregate (`process_aggregate`, algorithms.process_rewards). The policy writes the markers itself, as
the solutions the PRM was trained on have them: a policy fine-tuned on that format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_rlhf.algorithms.process_rewards import aggregate_steps, step_probabilities
from hpc_rlhf.config import ConfigError
from hpc_rlhf.data.examples import single_token_id
from hpc_rlhf.models.folders import process_reward_record


@dataclass(frozen=True)
class ProcessRewardSpec:
    """What scoring a process reward model needs: its marker's id and its reward tokens' ids (the first: right)."""
    marker_id: int
    reward_ids: tuple[int, ...]


def process_reward_spec(folder: str | Path, tokenizer, key: str) -> ProcessRewardSpec | None:
    """The spec a process reward model's config.json records, with the ids of the policy's tokenizer; None for
    any other model folder. ConfigError naming `key` (the reward model's entry) when the record is unusable."""
    record = process_reward_record(folder)
    if record is None:
        return None
    marker, tokens = (record.get("placeholder_token"), record.get("reward_tokens")) if isinstance(record, dict) \
        else (None, None)
    if not isinstance(marker, str) or not isinstance(tokens, list) or len(tokens) < 2 or \
            not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{key}: '{Path(folder) / 'config.json'}' has a process_reward record without a "
                          f"placeholder_token and two or more reward_tokens: {record!r}")
    try:
        return ProcessRewardSpec(single_token_id(tokenizer, marker, f"{key} placeholder_token"),
                                 tuple(single_token_id(tokenizer, t, f"{key} reward token") for t in tokens))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def step_positions(input_ids: torch.Tensor, may_be_step: torch.Tensor, marker_id: int) -> list[list[int]]:
    """Per row, the positions of its markers where `may_be_step` (B, T) allows one (the response's tokens), in
    order."""
    found = ((input_ids == marker_id) & may_be_step.bool()).nonzero().tolist()
    positions: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    for row, column in found:
        positions[row].append(column)
    return positions


def rewards_of_steps(step_logits: torch.Tensor, positions: list[list[int]], spec: ProcessRewardSpec,
                     how: str) -> torch.Tensor:
    """(B,) float32 reward of each row from its steps' logits: `step_logits` (N, V) the model's logits at every
    row's markers (`positions`, row by row, in order), their scores aggregated by `how`."""
    reward_ids = torch.tensor(spec.reward_ids, dtype=torch.long, device=step_logits.device)
    steps = step_probabilities(step_logits[:, reward_ids]).cpu()
    return aggregate_steps(list(steps.split([len(found) for found in positions])), how)


def process_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, may_be_step: torch.Tensor,
                    spec: ProcessRewardSpec, how: str) -> torch.Tensor:
    """(B,) float32 reward of each row from a process reward model (a causal LM, frozen): its steps' scores
    aggregated by `how`. Rows are padded (`attention_mask`); `may_be_step` marks the positions whose markers are
    steps (the responses'). The RL recipes' scorer also takes packed rows (rl/scoring.py)."""
    positions = step_positions(input_ids, may_be_step, spec.marker_id)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    device = logits.device
    rows = torch.tensor([i for i, found in enumerate(positions) for _ in found], dtype=torch.long, device=device)
    columns = torch.tensor([j for found in positions for j in found], dtype=torch.long, device=device)
    return rewards_of_steps(logits[rows, columns], positions, spec, how)
