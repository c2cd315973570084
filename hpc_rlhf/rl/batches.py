"""The data a step's phases hand each other: what the engines generated (`Generated`), a padded batch of samples
(`SampleBatch`), the step's `Experience` (phase 6 builds it: experience.py), and the pure conversions between the
two shapes of a per-sample quantity.

On the wire (hpc_rlhf.dist.exchange) every per-sample quantity is ragged: one 1-D tensor per sample, as long as
that sample's response (log-probs, values, KL) or of length 1 (scores). For a forward pass the samples become a
right-padded batch:

    input_ids      (B, T)    prompt + response, padded on the right
    attention_mask (B, T)
    action_mask    (B, T-1)  1 where position t predicts a response token (token t+1 is part of the response)

so a per-token quantity q of sample i lives at `q[i, p_i - 1 : p_i - 1 + r_i]` (p_i prompt length, r_i response
length) in the (B, T-1) layout. `to_ragged` and `from_ragged` move between the two layouts.

Samples are ordered prompt-major (prompt k, sample j at k * n + j) everywhere, and a role of size m takes
contiguous shards (`shard_bounds`) so that gathering the shards in group-rank order restores that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hpc_rlhf.algorithms.logprobs import token_logprobs


def shard_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `count` items are cut into `parts` contiguous, near-equal parts."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


# What travels with each episode (multi-turn samples, rl/episodes.py), as float32: its environment's reward, its
# turns and tool calls, whether it was truncated or dropped (env.on_error=skip), and its engine's time in the
# environment and in the whole rollout, spread over the engine's episodes so that sums over samples are totals.
EPISODE_FIELDS = ("env_reward", "turns", "tool_calls", "truncated", "failed", "env_s", "wall_s")


@dataclass
class Generated:
    """What the rollout engines generated for a batch, prompt-major: one engine's share on its first rank, or the
    whole batch where the exchange delivered it.

    responses  token ids after the prompt, one 1-D tensor per sample (an episode's: every model turn and every
               observation, in order)
    logprobs   the engine's sampling log-prob of each response token (0 at observation tokens); None where not
               asked for (evaluation)
    masks      episodes only: bool, True at the tokens the model generated
    episodes   episodes only: (samples, len(EPISODE_FIELDS)) float32
    """
    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor] | None = None
    masks: list[torch.Tensor] | None = None
    episodes: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.responses)

    @staticmethod
    def concatenated(parts: Sequence["Generated"]) -> "Generated":
        """The engines' shares, in engine order, as one batch."""
        def joined(name):
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else [t for v in values for t in v]
        episodes = [p.episodes for p in parts]
        return Generated(joined("responses"), joined("logprobs"), joined("masks"),
                         None if any(e is None for e in episodes) else torch.cat(episodes))


@dataclass
class SampleBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_lens: list[int]
    response_lens: list[int]

    def to(self, device) -> "SampleBatch":
        return SampleBatch(self.input_ids.to(device), self.attention_mask.to(device), self.action_mask.to(device),
                           self.prompt_lens, self.response_lens)

    def select(self, rows: Sequence[int]) -> "SampleBatch":
        """Rows `rows`, cut to the width their longest sample needs."""
        prompt_lens = [self.prompt_lens[i] for i in rows]
        response_lens = [self.response_lens[i] for i in rows]
        width = max([2] + [p + r for p, r in zip(prompt_lens, response_lens)])
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return SampleBatch(self.input_ids[index, :width], self.attention_mask[index, :width],
                           self.action_mask[index, :width - 1], prompt_lens, response_lens)


@dataclass
class Experience:
    """One RL step's samples and what the roles computed about them, on the actor and critic ranks.

    Per-token tensors are (B, T-1), aligned with `batch.action_mask`; `scores` is (B,). `kl` is the configured
    estimator's per-token KL of the actor (before the update) to the reference, 0 without a reference model.
    `values` and `returns` exist with a critic. `rollout_logps` are the engines' sampling log-probs. `loss_mask`
    (0/1, float like the action mask) holds the response tokens the policy loss trains on: the action mask less what
    importance sampling, the overlong filter or dynamic sampling dropped (equal to it when none is on);
    `is_weights` the importance weights of the tokens (None without a correction).
    """
    batch: SampleBatch
    scores: torch.Tensor
    rollout_logps: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    is_weights: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.batch.input_ids.shape[0]

    def select(self, rows: Sequence[int], device=None) -> "Experience":
        """The samples `rows` (a micro-batch), cut to their width and moved to `device`."""
        batch = self.batch.select(rows)
        width = batch.action_mask.shape[1]
        index = torch.as_tensor(list(rows), dtype=torch.long)

        def cut(t):
            if t is None:
                return None
            rows_of_t = t[index, :width] if t.dim() == 2 else t[index]
            return rows_of_t if device is None else rows_of_t.to(device)

        return Experience(batch if device is None else batch.to(device),
                          **{name: cut(getattr(self, name)) for name in PER_SAMPLE_FIELDS})

    def tokens(self, rows: Sequence[int]) -> float:
        """Response tokens of the samples `rows`."""
        return float(sum(self.batch.response_lens[i] for i in rows))


# The Experience fields that hold one row per sample (all but the batch), which a micro-batch selects
PER_SAMPLE_FIELDS = ("scores", "rollout_logps", "old_logps", "ref_logps", "kl", "advantages", "loss_mask", "is_weights",
                     "values", "returns")


def make_batch(prompts: Sequence[Sequence[int]], responses: Sequence[torch.Tensor], pad_id: int,
               masks: Sequence[torch.Tensor] | None = None) -> SampleBatch:
    """Prompt + response token ids per sample -> a right-padded batch with its action mask: every response token,
    or where `masks` are given (episodes), the response tokens the model generated (observations are holes)."""
    if len(prompts) != len(responses) or (masks is not None and len(masks) != len(responses)):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses"
                         + ("" if masks is None else f" and {len(masks)} masks"))
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(max(lengths), 2)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    action_mask = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row = torch.cat([torch.as_tensor(list(p), dtype=torch.long), torch.as_tensor(r, dtype=torch.long)])
        input_ids[i, :len(row)] = row
        attention_mask[i, :len(row)] = 1
        if masks is None:
            action_mask[i, len(p) - 1:len(p) - 1 + len(r)] = 1
        else:
            if len(masks[i]) != len(r):
                raise ValueError(f"sample {i}: a mask of {len(masks[i])} for a response of {len(r)} tokens")
            action_mask[i, len(p) - 1:len(p) - 1 + len(r)] = masks[i].to(action_mask.dtype)
    return SampleBatch(input_ids, attention_mask, action_mask, [len(p) for p in prompts],
                       [len(r) for r in responses])


def to_ragged(values: torch.Tensor, batch: SampleBatch) -> list[torch.Tensor]:
    """(B, T-1) per-token values -> one 1-D tensor per sample over its response tokens."""
    out = []
    for i, (p, r) in enumerate(zip(batch.prompt_lens, batch.response_lens)):
        out.append(values[i, p - 1:p - 1 + r].detach().cpu())
    return out


def from_ragged(seqs: Sequence[torch.Tensor], batch: SampleBatch, dtype=torch.float32) -> torch.Tensor:
    """One 1-D tensor per sample over its response tokens -> (B, T-1), zero outside the responses."""
    out = torch.zeros(batch.action_mask.shape, dtype=dtype)
    for i, (p, r, seq) in enumerate(zip(batch.prompt_lens, batch.response_lens, seqs)):
        if len(seq) != r:
            raise ValueError(f"sample {i}: {len(seq)} values for a response of {r} tokens")
        out[i, p - 1:p - 1 + r] = seq.to(dtype)
    return out


def response_logprobs(logits: torch.Tensor, batch: SampleBatch, temperature: float = 1.0) -> torch.Tensor:
    """(B, T, V) logits -> (B, T-1) log-probs of the next token (meaningful where action_mask is 1)."""
    return token_logprobs(logits[:, :-1], batch.input_ids[:, 1:].to(logits.device), temperature=temperature)
