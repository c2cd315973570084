"""Scoring pieces of the RL step (phase 4 of trainers/ppo.py): a role's work on its shard of the samples,
the rule and remote rewards, and what is logged about a step's samples.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from hpc_rlhf import rewards as reward_fns
from hpc_rlhf.algorithms.kl import kl_estimate
from hpc_rlhf.dist import exchange, groups
from hpc_rlhf.trainers import rl_exchange
from hpc_rlhf.trainers.experience import Experience, SampleBatch, from_ragged, shard_bounds


def score_on_shard(role: str, samples: int, micro: int, batch_of: Callable[[int, int], SampleBatch],
                   one: Callable[[SampleBatch], list[torch.Tensor]]) -> list[torch.Tensor] | None:
    """`one` over this rank's contiguous shard of the `samples` in micro-batches; the role leader gets every
    rank's results in sample order (None elsewhere). Every rank of the role runs as many passes as the one with
    the largest shard (a ZeRO-3 model gathers parameters collectively in each): the extra ones on one sample,
    dropped."""
    size, index = len(groups.role_ranks(role)), groups.rank_in_role(role)
    start, end = shard_bounds(samples, size, index)
    passes = math.ceil(math.ceil(samples / size) / micro)
    results = []
    for p in range(passes):
        lo, hi = start + p * micro, min(start + (p + 1) * micro, end)
        if lo < hi:
            results += one(batch_of(lo, hi))
        else:
            one(batch_of(0, 1))
    gathered = exchange.gather_ragged(results, dst=groups.role_leader(role), group=groups.role_group(role),
                                      tag=f"{role}-scores", dtype=torch.float32)
    return exchange.flatten_ranks(gathered) if gathered is not None else None


def rule_scores(cfg, rule_functions, tokenizer, leader: int, prompts: list[str],
                responses: list[torch.Tensor] | None, answers: list[str | None]) -> list[torch.Tensor] | None:
    """Rule functions and the HTTP endpoint, weighted and summed, computed once on `leader` (the only rank that
    decodes the responses, the sender of the route `scores/rules`): [(B,)] there, None elsewhere."""
    route = groups.route("scores/rules")
    if route.src != leader:
        raise ValueError(f"rule rewards run on rank {route.src} (hpc_rlhf.dist.groups.rule_reward_rank), not {leader}")
    if dist.get_rank() != leader:
        return None
    texts = [tokenizer.decode(r.tolist(), skip_special_tokens=False) for r in responses]
    total = torch.zeros(len(texts))
    weights = cfg.reward.function_weights or [1.0] * len(rule_functions)
    for (spec, fn), w in zip(rule_functions, weights):
        total += w * torch.tensor(reward_fns.call_reward_function(fn, spec, prompts, texts, answers))
    if cfg.reward.http_url:
        total += cfg.reward.http_weight * torch.tensor(reward_fns.remote_rewards(
            cfg.reward.http_url, prompts, texts, answers, timeout_s=cfg.reward.http_timeout_s))
    return [total]


def share_scores(local: dict[str, list[torch.Tensor] | None], roles: list[str], rules: list[torch.Tensor] | None,
                 with_rules: bool, batch: SampleBatch | None) -> dict[str, torch.Tensor]:
    """Every scoring role's results (`local[role]`, on its leader) and the rule rewards (`rules`, on their rank)
    to the trained roles, all in one round (`rl_exchange.share_known`; the lengths follow from the responses):
    dense on those ranks, (B, T-1) per-token tensors for actor, critic and ref, (B,) scores of each reward model
    and "rules" (zeros without rule or remote rewards)."""
    def lengths_of(role):
        if batch is None:
            return None
        return [1] * len(batch.response_lens) if role.startswith("reward") or role == "rules" else batch.response_lens

    messages = {f"scores/{role}": (local.get(role), lengths_of(role)) for role in roles}
    if with_rules:
        messages["scores/rules"] = (rules, None if batch is None else [len(batch.response_lens)])
    scored = {}
    for key, full in rl_exchange.share_known(messages).items():
        role = key.removeprefix("scores/")
        if full is not None:
            per_sample = role.startswith("reward") or role == "rules"
            scored[role] = torch.cat(full) if per_sample else from_ragged(full, batch)
    if not with_rules and batch is not None:
        scored["rules"] = torch.zeros(len(batch.response_lens))
    return scored


def sample_figures(exp: Experience, kl_estimator: str, has_ref: bool, tis_cap: float | None) -> dict[str, float]:
    """What is logged about a step's samples, from its Experience (on rank 0, the actor's leader): rewards (the
    combined scores), KL of the actor to the reference per sequence (k1 and the configured estimator, by name),
    response length, how far the engines' sampling log-probs are from the actor's (`rollout_logprob_abs_diff`:
    mean over response tokens; `_max`: the largest), and with truncated importance sampling the weights
    pi_old / pi_rollout of the tokens: `tis_weight` the mean of the truncated weights the loss uses,
    `tis_weight_max` the largest weight before truncation, `tis_clipped` the share of tokens truncated."""
    mask = exp.batch.action_mask
    scores = exp.scores
    figures = {"reward": scores.mean().item(), "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
               "response_length": float(sum(exp.batch.response_lens)) / len(scores)}
    if has_ref:
        for kind in dict.fromkeys(("k1", kl_estimator)):
            kl = exp.kl if kind == kl_estimator else kl_estimate(exp.old_logps, exp.ref_logps, kind=kind) * mask
            figures[f"kl_{kind}"] = kl.sum(1).mean().item()
    tokens = mask.sum().clamp(min=1)
    gap = (exp.rollout_logps - exp.old_logps).abs() * mask
    figures["rollout_logprob_abs_diff"] = (gap.sum() / tokens).item()
    figures["rollout_logprob_abs_diff_max"] = gap.max().item()
    if tis_cap is not None:
        weights = torch.exp(exp.old_logps - exp.rollout_logps) * mask
        figures["tis_weight"] = (weights.clamp(max=tis_cap).sum() / tokens).item()
        figures["tis_weight_max"] = weights.max().item()
        figures["tis_clipped"] = ((weights > tis_cap).sum() / tokens).item()
    return figures
