"""Phase 7 of the RL step, training: the actor (clipped policy loss) and the critic (clipped value loss) each take
`rl.ppo_epochs` passes over the step's experience on their own group with DeepSpeed, at the same time on their own
ranks, through one mini-batch loop (`train_role`).

Losses are means over the whole optimizer step (all its micro-batches and ranks), not means of micro-batch means.
Log-probs are those of the sampling distribution softmax(logits / T), T the rollout temperature, as the engines
report theirs: the PPO ratio and the KL estimators are unbiased only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from hpc_rlhf.algorithms.kl import kl_estimate
from hpc_rlhf.algorithms.logprobs import masked_sum
from hpc_rlhf.algorithms.losses import cispo_loss, gspo_loss, loss_normalizer, policy_loss, value_loss
from hpc_rlhf.config import TrainSection
from hpc_rlhf.dist import exchange, groups
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.lora import unwrap_model, value_head_name
from hpc_rlhf.rl.config import Config, clip_range, loss_aggregation
from hpc_rlhf.rl import micro_batches
from hpc_rlhf.rl.batches import Experience, shard_bounds
from hpc_rlhf.rl.packed import PADDED, Layout, policy_forward, sample_lengths, value_forward
from hpc_rlhf.utils import faults


@dataclass(frozen=True)
class Shuffle:
    """The seeded order in which a role visits a step's samples in each epoch: seed * seed_stride + step *
    step_stride + epoch. The two roles use different strides so that their orders differ."""
    seed_stride: int
    step_stride: int

    def seed(self, seed: int, step: int, epoch: int) -> int:
        return seed * self.seed_stride + step * self.step_stride + epoch


ACTOR_SHUFFLE = Shuffle(seed_stride=31, step_stride=7)
CRITIC_SHUFFLE = Shuffle(seed_stride=37, step_stride=11)


def train_actor(actor: TrainEngine, cfg: Config, step: int, exp: Experience, device, temperature: float,
                layout: Layout = PADDED) -> dict[str, float]:
    """One policy update of the actor on the step's experience (its figures, the same on its ranks): the loss of
    rl.policy_loss on the tokens of the loss mask, each weighted by its importance weight (rl.is_correction).
    `layout`: its forwards on padded or packed rows (rl.padding_free)."""
    rl = cfg.rl
    clip_eps, clip_eps_high = clip_range(rl)
    first_forward = rl.old_logprobs == "first_forward"

    def loss_of(micro: Experience, tokens: float, policy_normalizer: float, share: float):
        mask = micro.loss_mask
        logps, entropies = policy_forward(actor, micro.batch, temperature, layout)
        # One optimizer step per batch (rl/config.py checks it): these weights are still the old policy's.
        old_logps = logps.detach() if first_forward else micro.old_logps
        common = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, loss_agg=loss_aggregation(rl),
                      normalizer=policy_normalizer, token_weights=micro.is_weights)
        if rl.policy_loss == "gspo":
            policy, clip_fraction, approx_kl = gspo_loss(logps, old_logps, micro.advantages, mask, **common)
        elif rl.policy_loss == "cispo":
            policy, clip_fraction, approx_kl = cispo_loss(logps, old_logps, micro.advantages, mask, **common)
        else:
            policy, clip_fraction, approx_kl = policy_loss(logps, old_logps, micro.advantages, mask,
                                                           dual_clip=rl.dual_clip, **common)
        with torch.set_grad_enabled(rl.entropy_coef > 0):
            entropy = masked_sum(entropies(), mask)
        loss = policy - rl.entropy_coef * entropy / tokens
        figures = {"policy_loss": policy.detach(), "entropy": entropy.detach() / tokens,
                   "clip_fraction": clip_fraction * share, "approx_kl": approx_kl * share}
        if rl.kl_coef > 0 and not rl.kl_in_reward:
            kl = masked_sum(kl_estimate(logps, micro.ref_logps, kind=rl.kl_estimator), mask) / tokens
            loss = loss + rl.kl_coef * kl
            figures["kl_loss"] = kl.detach()
        return loss, figures

    return train_role("actor", actor, cfg.train, rl.ppo_epochs, loss_aggregation(rl), step, exp, exp.loss_mask,
                      loss_of, ACTOR_SHUFFLE, device, micro_tokens=rl.micro_batch_tokens)


def train_critic(critic: TrainEngine, cfg: Config, step: int, exp: Experience, device, layout: Layout = PADDED
                 ) -> dict[str, float]:
    """One clipped value-loss update of the critic on the step's experience (its figures, the same on its ranks)."""
    clip = cfg.rl.value_clip_eps
    head = getattr(unwrap_model(critic.module), value_head_name(critic.module))

    def loss_of(micro: Experience, tokens: float, policy_normalizer: float, share: float):
        mask = micro.batch.action_mask
        # Through the engine's forward, as the actor's: the bare module's trained wrongly under ZeRO-3 (the
        # gradient norm 0.86 where ZeRO-0 and ZeRO-2 give 30.7, and no clipping).
        values = value_forward(critic, micro.batch, layout, head=head)[:, :-1]
        loss, clip_fraction = value_loss(values.float(), micro.values, micro.returns, mask, clip_eps=clip,
                                         normalizer=tokens)
        return loss, {"value_loss": loss.detach(), "value_clip_fraction": clip_fraction * share}

    return train_role("critic", critic, cfg.critic_train, cfg.rl.ppo_epochs, loss_aggregation(cfg.rl), step, exp,
                      exp.batch.action_mask, loss_of, CRITIC_SHUFFLE, device,
                      micro_tokens=cfg.rl.micro_batch_tokens)


def train(actor: TrainEngine | None, critic: TrainEngine | None, cfg: Config, step: int, exp: Experience | None,
          device, temperature: float, layouts: Mapping[str, Layout] | None = None
          ) -> tuple[dict[str, float], dict[str, float]]:
    """Phase 7 on this rank: the actor and the critic it holds train on the step's Experience, each on its own
    group (ranks holding neither pass through). The actor's figures and the critic's. `layouts`: each role's
    (packed rows, sequence blocks; padded rows where not given)."""
    layouts = layouts or {}
    actor_figures = (train_actor(actor, cfg, step, exp, device, temperature, layouts.get("actor", PADDED))
                     if actor is not None else {})
    critic_figures = (train_critic(critic, cfg, step, exp, device, layouts.get("critic", PADDED))
                      if critic is not None else {})
    return actor_figures, critic_figures


def train_role(role: str, engine: TrainEngine, train: TrainSection, ppo_epochs: int, loss_agg: str, step: int,
               exp: Experience, token_mask: torch.Tensor, loss_of, shuffle: Shuffle, device, micro_tokens: int = 0
               ) -> dict[str, float]:
    """PPO's mini-batch loop for one trained role: `ppo_epochs` passes over the step's samples in a seeded
    order, one optimizer step per `train.batch_size` samples, each rank of the role taking its contiguous
    share in micro-batches (on `device`) of `train.micro_batch_size` samples, or of at most `micro_tokens` tokens
    (rl.micro_batch_tokens, hpc_rlhf/rl/micro_batches.py). Micro-batches by tokens vary in number from one
    optimizer step to the next: every rank of the role runs as many as its busiest replica needs, and tells
    DeepSpeed which backward ends the accumulation.

    `loss_of(micro, tokens, policy_normalizer, share)` returns (loss, figures) where the loss and each figure are
    this micro-batch's part of a mean over the optimizer step's `tokens` tokens of `token_mask` (B, T-1: the loss
    mask for the actor, the response tokens for the critic), or its `policy_normalizer` sequences or tokens, for
    the policy loss (`share`: the micro-batch's tokens / `tokens`): summed over the step's micro-batches and
    ranks they are that mean. DeepSpeed divides each backward by the accumulation steps and averages the
    gradients over the role's ranks, so the loss is scaled back by both before backward. Figures stay
    tensors until the end: one host transfer and one all-reduce per RL step.

    A sequence-parallel role (placement key `<kind>_sp=K`) shares each micro-batch among the K ranks of a block:
    the samples are cut among the blocks, and each rank of a block computes the same loss from the whole rows,
    its backward giving its part of the block's gradient (hpc_rlhf/models/sequence_parallel.py). The parts add
    up in DeepSpeed's average over all the role's ranks, so the scale stays that of one rank per micro-batch;
    the figures, counted once per rank of a block, are divided by K.
    """
    size, index = len(groups.role_ranks(role)), groups.rank_in_role(role)
    per_block = len(groups.sequence_ranks(role))
    replicas, replica = size // per_block, index // per_block
    gradient_scale = engine.gradient_accumulation_steps * size
    sums: dict[str, torch.Tensor] = {}
    infos, updates, passes = [], 0, 0
    lengths = sample_lengths(exp.batch)
    for epoch in range(ppo_epochs):
        seed = shuffle.seed(train.seed, step, epoch)
        order = torch.randperm(len(exp), generator=torch.Generator().manual_seed(seed))
        for start in range(0, len(exp), train.batch_size):
            chosen = order[start:start + train.batch_size].tolist()
            chosen_mask = token_mask[chosen]
            tokens = max(float(chosen_mask.sum()), 1.0)
            policy_normalizer = loss_normalizer(chosen_mask, loss_agg)
            shards = [chosen[slice(*shard_bounds(len(chosen), replicas, r))] for r in range(replicas)]
            mine = shards[replica]
            parts = micro_batches.cuts([lengths[i] for i in mine], train.micro_batch_size, micro_tokens)
            if micro_tokens:
                count = micro_batches.passes([[lengths[i] for i in s] for s in shards], train.micro_batch_size,
                                             micro_tokens)
                parts = micro_batches.split_to(parts, count)
            passes += len(parts)
            for k, (a, b) in enumerate(parts):
                rows = mine[a:b]
                micro = exp.select(rows, device=device)
                share = float(token_mask[rows].sum()) / tokens  # counted on the host: no device sync
                loss, figures = loss_of(micro, tokens, policy_normalizer, share)
                loss = faults.poison(loss, step + 1)  # failure handling: HPC_RLHF_FAULT kind=nan
                engine.backward(loss * gradient_scale, boundary=(k == len(parts) - 1) if micro_tokens else None)
                infos.append(engine.step())
                for key, value in figures.items():
                    sums[key] = sums.get(key, 0.0) + value.detach().double()
            updates += 1
    keys = sorted(sums)
    comm = exchange.comm_device(groups.role_group(role))
    totals = torch.stack([sums[k].to(comm) for k in keys]) if keys else torch.zeros(0, device=comm)
    dist.all_reduce(totals, group=groups.role_group(role))
    out = dict(zip(keys, (totals / (updates * per_block)).tolist()))
    stepped = [i for i in infos if i.stepped]
    out[f"{role}_grad_norm"] = stepped[-1].grad_norm if stepped else float("nan")
    out[f"{role}_lr"] = stepped[-1].lr if stepped else engine.lr
    out[f"{role}_skipped"] = float(any(i.skipped for i in stepped))
    out[f"{role}_micro_batches"] = passes / max(updates, 1)  # per optimizer step, on every rank of the role
    return out
