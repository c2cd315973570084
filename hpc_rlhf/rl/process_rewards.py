"""A process reward model on a reward role: a folder `hpc-rlhf prm` wrote, in `reward.models` beside (or instead of)
outcome reward models.

Such a folder is a causal LM whose config.json records `process_reward`: the marker token written after each step
and the reward tokens ("+" first). The RL recipes recognise it by that record and score each response by its
steps: every marker the policy wrote in its response (generated tokens only: an environment's observations are
not the policy's steps) is a step, its score the probability of the first reward token there, and the response's
reward their aggregate (`reward.process_aggregate`, algorithms.process_rewards). The policy writes the markers
itself, as the solutions the PRM was trained on have them: a policy fine-tuned on that format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hpc_rlhf.algorithms.process_rewards import aggregate_steps, step_probabilities
from hpc_rlhf.config import ConfigError
from hpc_rlhf.data.examples import single_token_id
from hpc_rlhf.models.folders import process_reward_record
from hpc_rlhf.rl.batches import SampleBatch


@dataclass(frozen=True)
class ProcessRewardSpec:
    """What scoring a process reward model needs: its marker's id and its reward tokens' ids (the first: right)."""
    marker_id: int
    reward_ids: tuple[int, ...]


def process_reward_spec(folder: str | Path, tokenizer, key: str) -> ProcessRewardSpec | None:
    """The spec a process reward model's config.json records, with the ids of the policy's tokenizer; None for
    any other model folder. ConfigError naming `key` (the reward.models entry) when the record is unusable."""
    path = Path(folder) / "config.json"
    record = process_reward_record(folder)
    if record is None:
        return None
    marker, tokens = (record.get("placeholder_token"), record.get("reward_tokens")) if isinstance(record, dict) \
        else (None, None)
    if not isinstance(marker, str) or not isinstance(tokens, list) or len(tokens) < 2 or \
            not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{key}: '{path}' has a process_reward record without a placeholder_token and two or more "
                          f"reward_tokens: {record!r}")
    try:
        return ProcessRewardSpec(single_token_id(tokenizer, marker, f"{key} placeholder_token"),
                                 tuple(single_token_id(tokenizer, t, f"{key} reward token") for t in tokens))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def response_markers(batch: SampleBatch, marker_id: int) -> list[list[int]]:
    """Per sample, the positions of the markers among its generated response tokens, in order."""
    markers = batch.input_ids == marker_id
    generated = torch.zeros_like(markers)
    generated[:, 1:] = batch.action_mask > 0  # action_mask[j - 1] covers token j
    found = (markers & generated).nonzero().tolist()
    positions: list[list[int]] = [[] for _ in range(batch.input_ids.shape[0])]
    for row, column in found:
        positions[row].append(column)
    return positions


def process_scores_of(model, spec: ProcessRewardSpec, how: str) -> Callable[[SampleBatch], list[torch.Tensor]]:
    """One reward per sample from a process reward model (a causal LM, frozen): its steps' scores aggregated."""
    reward_ids = torch.tensor(spec.reward_ids, dtype=torch.long)

    def one(sub: SampleBatch) -> list[torch.Tensor]:
        positions = response_markers(sub, spec.marker_id)
        logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False).logits
        rows = torch.tensor([i for i, found in enumerate(positions) for _ in found], dtype=torch.long)
        columns = torch.tensor([j for found in positions for j in found], dtype=torch.long)
        device = logits.device
        marker_logits = logits[rows.to(device), columns.to(device)][:, reward_ids.to(device)]
        steps = step_probabilities(marker_logits).cpu().split([len(found) for found in positions])
        return [v.reshape(1) for v in aggregate_steps(list(steps), how)]
    return one
