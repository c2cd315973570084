"""Phase 6 of the RL step, advantages: what the roles scored, on the actor and critic ranks, becomes the step's
`Experience` (batches.py): rewards, KL, advantages and returns (one pure function,
`algorithms.advantages.assemble_advantages`), the loss mask and the importance weights."""

from __future__ import annotations

from typing import Sequence

import torch

from hpc_rlhf.algorithms.advantages import assemble_advantages
from hpc_rlhf.algorithms.importance import off_policy_correction
from hpc_rlhf.algorithms.losses import loss_mask
from hpc_rlhf.algorithms.overlong import overlong_penalty, truncated_responses, truncated_share
from hpc_rlhf.rl.batches import Experience, SampleBatch
from hpc_rlhf.rl.config import is_correction, response_limit


def build_experience(cfg, batch: SampleBatch, scored: dict[str, torch.Tensor], rollout_logps: torch.Tensor,
                     reward_roles: Sequence[str], eos_id: int, keep_samples: torch.Tensor | None = None,
                     truncated: torch.Tensor | None = None) -> tuple[Experience, dict[str, float]]:
    """Phase 6, advantages: the roles' results on the actor and critic ranks (`scored`, messages.share_scores) ->
    the step's Experience, and what the assembly measured (logged by the step). `cfg` is the RL config
    (rl.config.Config); `keep_samples` (B,) bool, with dynamic sampling: the samples that fill the batch (the others
    are slots of prompts that carried no signal, left out of the advantages and the loss); `truncated` (B,) bool,
    with episodes: those cut at env.max_episode_tokens (else a response is cut when it is rollout.max_new_tokens
    long without an end-of-sequence token).

    1. scores: the rule and remote rewards (already weighted), plus DAPO's overlong penalty where rl.overlong_buffer
       is set, plus each reward model's weighted score; the KL estimate; advantages and returns with the estimator,
       and with a teacher (distill.teacher) its per-token term: one pure function,
       `algorithms.advantages.assemble_advantages`;
    2. the loss mask: the response tokens less those the importance-sampling correction drops (masked IS), less
       the responses cut by the length limit (rl.overlong_filter), less the samples dynamic sampling leaves out;
       the importance weights of the tokens (rl.is_correction).
    """
    rl = cfg.rl
    # rl.old_logprobs: the actor's scoring pass (recompute), else the engines' sampling log-probs stand in until
    # training (rollout: for good; first_forward: training takes its first forward's, rl/training.py)
    old_logps, mask = scored.get("actor", rollout_logps), batch.action_mask
    lengths = torch.tensor(batch.response_lens)
    _, limit = response_limit(cfg)
    rules = scored["rules"]
    if rl.overlong_buffer:
        rules = rules + overlong_penalty(lengths, limit, rl.overlong_buffer, rl.overlong_penalty)
    sample_mask = mask if keep_samples is None else mask * keep_samples.unsqueeze(-1).to(mask.dtype)
    assembled = assemble_advantages(
        rules, [scored[name] for name in reward_roles],
        cfg.reward.model_weights or [1.0] * len(reward_roles), old_logps, scored.get("ref"),
        sample_mask, kl_estimator=rl.kl_estimator, estimator=rl.advantage, n=cfg.rollout.n_samples,
        kl_coef=rl.kl_coef, kl_in_reward=rl.kl_in_reward, gamma=rl.gamma, lam=rl.lam, values=scored.get("critic"),
        whiten=rl.whiten_advantages, normalize_scores=rl.normalize_rewards, score_clip=cfg.reward.clip,
        teacher_logps=scored.get("teacher"), teacher_coef=cfg.distill.coef)

    mode, params = is_correction(rl)
    correction = off_policy_correction(old_logps, rollout_logps, mask, mode, **params)
    if truncated is None:
        last_tokens = torch.tensor([int(batch.input_ids[i, p + r - 1]) if r else -1
                                    for i, (p, r) in enumerate(zip(batch.prompt_lens, batch.response_lens))])
        truncated = truncated_responses(lengths, last_tokens, [eos_id], limit)
    keep = ~truncated if rl.overlong_filter else torch.ones(len(lengths), dtype=torch.bool)
    if keep_samples is not None:
        keep = keep & keep_samples
    trained = loss_mask(correction.mask, keep_sequences=keep).to(mask.dtype)
    figures = {"truncated_share": truncated_share(truncated).item()}
    if assembled.teacher_kl is not None:  # mean over the sampled tokens, and its sum over a response
        figures["teacher_kl"] = (assembled.teacher_kl.sum() / sample_mask.sum().clamp(min=1)).item()
        figures["teacher_kl_per_response"] = assembled.teacher_kl.sum(1).mean().item()
    if mode != "none":
        figures.update(is_masked_share=correction.masked_share.item(),
                       is_truncated_share=correction.truncated_share.item())
    experience = Experience(batch, assembled.scores, rollout_logps, old_logps, scored.get("ref", old_logps),
                            assembled.kl, assembled.advantages, trained, correction.weights, scored.get("critic"),
                            assembled.returns)
    return experience, figures
