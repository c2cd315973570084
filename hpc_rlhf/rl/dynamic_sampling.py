"""DAPO's dynamic sampling in the RL step (`rl.dynamic_sampling`): prompts whose samples all got the same reward
carry no signal for a group estimator, so the step drops them and fills its batch from further generation rounds,
up to `rl.dynamic_sampling_max_rounds` in all. The mathematics (which groups are uniform, which fill the batch) is
algorithms/dynamic_sampling.py; this module keeps the rounds of one step and assembles the batch the step trains on.

- The prompts of round r of batch b are a pure function of (seed, b, r) (`prompts.batch_rows`), and so is their
  sampling seed (`round_seed`): nothing about them is sent. Round 0 is the step's ordinary batch.
- Whether another round is needed depends on the rewards, which only the trained roles' ranks hold: the logging
  rank (the actor's leader) decides and tells every rank, one small all-reduce per round (`dist.agree.decided_by`).
- The trained batch keeps its size (rollout.prompts_per_step groups of rollout.n_samples), so every optimizer step
  sees the micro-batches it expects: the chosen groups first (round order, then prompt order), then, when the
  rounds ran out before the batch was full, groups of round 0 that carried no signal, as slots left out of the
  advantages and the loss (`keep_samples`); the step logs how many.
- Extra rounds are generated inside the step with the weights the engines hold (also with asynchronous RL, where
  round 0 was generated up to K versions earlier), so they end with the step: checkpoints need nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hpc_rlhf.algorithms.advantages import combine_scores
from hpc_rlhf.algorithms.dynamic_sampling import dynamic_sampling_figures, fill_batch, uniform_groups
from hpc_rlhf.dist.agree import decided_by
from hpc_rlhf.rl.batches import Generated, SampleBatch, from_ragged, make_batch, to_ragged
from hpc_rlhf.rl.messages import per_sample_role
from hpc_rlhf.rl.rollout import batch_seed

# Round r > 0 of a batch samples with its batch's seed + r * ROUND_SEED_OFFSET: far beyond any batch index, so no
# round shares a stream with another batch.
ROUND_SEED_OFFSET = 1_000_000_007


def round_seed(seed: int, index: int, round_index: int) -> int:
    """The sampling seed of round `round_index` of batch `index` (round 0: the batch's own seed)."""
    return batch_seed(seed, index) + round_index * ROUND_SEED_OFFSET


@dataclass
class Round:
    """One generation round as the trained ranks hold it: per sample its prompt ids, what the engines generated,
    the sampling log-probs and every role's results (ragged: one tensor per sample), and which of its groups carry
    signal."""
    prompt_ids: list
    generated: Generated
    rollout_logps: list[torch.Tensor]
    scored: dict[str, list[torch.Tensor]]
    kept: torch.Tensor  # (prompts,) bool


class Rounds:
    """The rounds of one step on a trained role's rank: add each as it is scored, ask whether the batch is full,
    then assemble the batch to train on."""

    def __init__(self, cfg, reward_roles: list[str]):
        self.n = cfg.rollout.n_samples
        self.groups_wanted = cfg.rollout.prompts_per_step
        self.model_weights = cfg.reward.model_weights or [1.0] * len(reward_roles)
        self.reward_roles = reward_roles
        self.rounds: list[Round] = []

    def add(self, prompt_ids: list, generated: Generated, batch: SampleBatch, rollout_logps: torch.Tensor,
            scored: dict[str, torch.Tensor]) -> None:
        """A scored round (dense, in `batch`'s layout). Its groups carry signal unless their task scores (the rule
        and remote rewards plus the weighted reward models: before any KL or length shaping) are all equal."""
        task = combine_scores(scored["rules"], [scored[name] for name in self.reward_roles], self.model_weights)
        kept = ~uniform_groups(task, self.n)
        ragged = {role: list(values.reshape(-1, 1)) if per_sample_role(role) else to_ragged(values, batch)
                  for role, values in scored.items()}
        self.rounds.append(Round(list(prompt_ids), generated, to_ragged(rollout_logps, batch), ragged, kept))

    def chosen(self) -> list[torch.Tensor]:
        return fill_batch([r.kept for r in self.rounds], self.groups_wanted)

    def full(self) -> bool:
        return sum(int(c.sum()) for c in self.chosen()) >= self.groups_wanted

    def figures(self) -> dict[str, float]:
        """groups_filtered_share, generation_rounds, extra_samples_per_trained, and the slots left empty."""
        chosen = self.chosen()
        figures = dynamic_sampling_figures([r.kept for r in self.rounds], chosen, self.n)
        figures["groups_unfilled"] = float(self.groups_wanted - sum(int(c.sum()) for c in chosen))
        return figures

    def assemble(self, pad_id: int
                 ) -> tuple[SampleBatch, Generated, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The batch to train on: (batch, what the engines generated for it, sampling log-probs (B, T-1), every
        role's results in the layout `share_scores` gives, keep_samples (B,) bool)."""
        picks = [(r, g) for r, chosen in zip(self.rounds, self.chosen()) for g in chosen.nonzero().flatten().tolist()]
        kept_count = len(picks)
        first = self.rounds[0]
        picks += [(first, g) for g in (~first.kept).nonzero().flatten().tolist()][:self.groups_wanted - kept_count]
        rows = [(r, g * self.n + i) for r, g in picks for i in range(self.n)]
        generated = Generated([r.generated.responses[s] for r, s in rows],
                              [r.generated.logprobs[s] for r, s in rows])
        if first.generated.masks is not None:  # episodes
            generated.masks = [r.generated.masks[s] for r, s in rows]
            generated.episodes = torch.stack([r.generated.episodes[s] for r, s in rows])
        batch = make_batch([r.prompt_ids[s] for r, s in rows], generated.responses, pad_id, generated.masks)
        rollout_logps = from_ragged([r.rollout_logps[s] for r, s in rows], batch)
        scored = {}
        for role in first.scored:
            per_sample = [r.scored[role][s] for r, s in rows]
            scored[role] = torch.cat(per_sample) if per_sample_role(role) else from_ragged(per_sample, batch)
        keep = torch.tensor([i < kept_count * self.n for i in range(len(rows))])
        return batch, generated, rollout_logps, scored, keep


def fill_from_rounds(cfg, reward_roles: list[str], trained: bool, decider: int, pad_id: int, round_zero: tuple,
                     another_round: Callable[[int], tuple]):
    """The batch a step trains on with dynamic sampling. `round_zero` is the step's batch as exchanged and scored:
    (prompt ids per sample, generated, batch, sampling log-probs, scores), as `Rounds.add` takes them; while rank `decider` finds the batch short
    of prompts that carry signal, `another_round(r)` generates, exchanges and scores round r (every rank calls it)
    and returns the same tuple. Returns (batch, generated, sampling log-probs, scores, keep_samples, figures) on the
    trained ranks (`trained`); elsewhere round zero's parts as given, None and {}."""
    rounds = Rounds(cfg, reward_roles) if trained else None
    if trained:
        rounds.add(*round_zero)
    for round_index in range(1, cfg.rl.dynamic_sampling_max_rounds):
        if not decided_by(decider, None if rounds is None else not rounds.full()):
            break
        more = another_round(round_index)
        if trained:
            rounds.add(*more)
    if not trained:
        _, generated, batch, rollout_logps, scored = round_zero
        return batch, generated, rollout_logps, scored, None, {}
    batch, generated, rollout_logps, scored, keep = rounds.assemble(pad_id)
    return batch, generated, rollout_logps, scored, keep, rounds.figures()
