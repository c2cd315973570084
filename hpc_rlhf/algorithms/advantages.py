"""Advantage estimators: GAE with a critic, and the critic-free group baselines (GRPO, Dr. GRPO, RLOO,
REINFORCE++ and its baseline variant); and `assemble_advantages`, the whole way from one RL step's scores and
log-probs to its advantages.

Shapes: per-token tensors are (batch, seq) with a mask marking response tokens. Group baselines take one
sequence reward per sample with the n samples of a prompt side by side: either (num_prompts, n) or flat
(num_prompts * n,) with sample i of prompt p at index p * n + i; they return the input's shape. Per-sequence
advantages reach the tokens through `broadcast_to_tokens`.
Everything returned is a training target, so inputs are detached and the results carry no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hpc_rlhf.algorithms.choices import ESTIMATORS
from hpc_rlhf.algorithms.kl import kl_estimate, kl_penalized_rewards
from hpc_rlhf.algorithms.logprobs import _check_shapes, masked_whiten



def _float(x: torch.Tensor) -> torch.Tensor:
    # Returns and advantages accumulate over hundreds of tokens: never in bf16.
    return x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation"):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}          (a reverse scan over the sequence)
        R_t     = A_t + V_t                                 (the critic's regression target)

    rewards, values, mask: (batch, seq). The response ends at its last marked token: the value after it is 0
    (generation stopped there). Masked positions are skipped, not treated as time steps: each response token's
    "next" is the next marked token of its row, so right padding, left padding, and masked holes inside a
    response (e.g. tool output in a multi-turn rollout) all work. Returns (advantages, returns), 0 where masked.
    """
    _check_shapes(rewards=rewards, values=values, mask=mask)
    if rewards.dim() != 2:
        raise ValueError(f"rewards, values and mask must be (batch, seq), got shape {tuple(rewards.shape)}")
    valid = mask != 0
    rewards = _float(rewards).masked_fill(~valid, 0)
    values = _float(values).masked_fill(~valid, 0)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        keep = valid[:, t]
        advantages[:, t] = torch.where(keep, advantage, 0.0)
        # A masked position passes the following token's state through unchanged.
        next_advantage = torch.where(keep, advantage, next_advantage)
        next_value = torch.where(keep, values[:, t], next_value)
    returns = (advantages + values).masked_fill(~valid, 0)
    return advantages, returns


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over the marked tokens of each row: GAE with V = 0 and lam = 1."""
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token its sequence's value: (batch,) x (batch, seq) mask -> (batch, seq)."""
    if seq_values.dim() != 1 or mask.dim() != 2 or seq_values.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_values must be (batch,) and mask (batch, seq) with the same batch, got "
                         f"{tuple(seq_values.shape)} and {tuple(mask.shape)}")
    return _float(seq_values).unsqueeze(-1) * (mask != 0)


def _by_group(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """View the rewards as (num_prompts, n), checking that they can be."""
    if n < 2:
        raise ValueError(f"n (samples per prompt) must be >= 2 for a group baseline, got {n}")
    if rewards.dim() == 2 and rewards.shape[1] == n:
        return _float(rewards)
    if rewards.dim() == 1 and rewards.numel() % n == 0:
        return _float(rewards).view(-1, n)
    raise ValueError(f"rewards must be (num_prompts, {n}) or (num_prompts * {n},) for n={n} samples per prompt, "
                     f"got shape {tuple(rewards.shape)}")


def grpo_advantages(rewards: torch.Tensor, n: int, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, "DeepSeekMath"): A_i = (r_i - mean_g) / (std_g + eps)
    over the n samples of the same prompt, std with Bessel's correction (n - 1). scale=False leaves out the
    division (that is Dr. GRPO). A group whose rewards are all equal gets advantage 0: it teaches nothing. That is
    set exactly: the float32 mean of equal rewards can be off by a rounding error, which the division by their std
    (then of the same size) would blow up (16 rewards of 0.7 gave |A| = 0.056).
    """
    groups = _by_group(rewards, n)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    return centred.masked_fill(_uniform(groups), 0.0).reshape(rewards.shape)


def _uniform(groups: torch.Tensor) -> torch.Tensor:
    """(num_prompts, 1) bool: the groups whose rewards are all exactly equal."""
    return (groups == groups[:, :1]).all(-1, keepdim=True)


def dr_grpo_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"):
    A_i = r_i - mean_g. Dividing by the group std over-weights prompts that are nearly always or nearly never
    solved; the paper drops it (and pairs this with a loss summed over tokens rather than averaged per
    sequence: `policy_loss(..., loss_agg="seq-mean-token-sum")`).
    """
    return grpo_advantages(rewards, n, scale=False)


def rloo_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):
    A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j, a baseline that does not depend on the sample it judges,
    so the policy gradient stays unbiased.
    """
    groups = _by_group(rewards, n)
    others_mean = (groups.sum(-1, keepdim=True) - groups) / (n - 1)
    return (groups - others_mean).masked_fill(_uniform(groups), 0.0).reshape(rewards.shape)


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            eps: float = 1e-8, whiten: bool = True) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models"): the discounted return of the per-token rewards (usually `kl_penalized_rewards`),
    G_t = sum_{k >= t} gamma^(k - t) r_k, whitened over all response tokens of the whole batch (not per prompt):
    A_t = (G_t - mean) / std. (batch, seq) -> (batch, seq), 0 where masked. whiten=False returns G_t as it is.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=eps) if whiten else returns


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, n: int, mask: torch.Tensor, eps: float = 1e-8,
                                     kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                                     whiten: bool = True) -> torch.Tensor:
    """REINFORCE++-baseline (same paper): subtract each prompt's group mean from the sequence rewards, give the
    result to every response token, then whiten over all response tokens of the batch.

    rewards (num_prompts * n,) or (num_prompts, n) in sample order; mask (num_prompts * n, seq).
    Returns (num_prompts * n, seq). With a per-token `kl` and kl_coef > 0, the KL penalty enters the token
    rewards after the group mean is taken (the centred score at the last token, -kl_coef * kl_t at every token)
    and the tokens get the discounted return of those rewards. whiten=False leaves out the final whitening.
    """
    centred = dr_grpo_advantages(rewards, n).reshape(-1)
    if mask.dim() != 2 or mask.shape[0] != centred.shape[0]:
        raise ValueError(f"mask must be ({centred.shape[0]}, seq), one row per sample, got {tuple(mask.shape)}")
    if kl is None or kl_coef == 0:
        if gamma == 1.0:
            tokens = broadcast_to_tokens(centred, mask)
            return masked_whiten(tokens, mask, eps=eps) if whiten else tokens
        kl, kl_coef = torch.zeros_like(mask, dtype=centred.dtype), 0.0
    return reinforce_pp_advantages(kl_penalized_rewards(centred, kl, mask, kl_coef), mask, gamma, eps, whiten)


def normalize_rewards(rewards: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Whiten rewards over the batch: (r - mean) / std (population std), over the masked entries when a mask
    is given. Keeps the scale of a reward model's output from setting the effective learning rate.
    """
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)
    return masked_whiten(_float(rewards), mask, eps=eps)


def clip_rewards(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    """Clamp rewards to [-clip, clip], so that one outlier score cannot dominate a batch."""
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    return rewards.clamp(-clip, clip)


def rl_advantages(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, estimator: str, n: int,
                  kl_coef: float = 0.0, kl_in_reward: bool = True, gamma: float = 1.0, lam: float = 0.95,
                  values: torch.Tensor | None = None, whiten: bool = True, normalize_scores: bool = False,
                  score_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantages of one RL step, from sequence scores and per-token KL: every option of the RL recipe in one
    pure function.

    scores (batch,) one per sample, prompt-major (n samples of a prompt side by side); kl (batch, seq) the
    per-token KL estimate to the reference (zeros without one); mask (batch, seq) the response tokens; values
    (batch, seq) the critic's, for "gae". Order of operations:
      1. normalize_scores: whiten the scores over the batch; score_clip > 0: clamp them to [-clip, clip];
      2. the KL penalty enters the reward when kl_in_reward (and kl_coef > 0), before any baseline:
         gae, reinforce_pp(_baseline): -kl_coef * kl_t at every token, the score at the last one;
         grpo, dr_grpo, rloo: the sequence reward is score - kl_coef * sum_t kl_t, then the group baseline;
      3. the estimator; `whiten` whitens the token advantages over the batch for gae and the reinforce_pp
         estimators (the group estimators are normalised per group by their definition).
    Returns (advantages (batch, seq), 0 where masked; returns for the critic, or None without one).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    _check_shapes(kl=kl, mask=mask)
    scores = _float(scores)
    if normalize_scores:
        scores = normalize_rewards(scores)
    if score_clip > 0:
        scores = clip_rewards(scores, score_clip)
    penalty = kl_coef if kl_in_reward else 0.0
    kl = _float(kl).masked_fill(mask == 0, 0)
    returns = None
    if estimator == "gae":
        if values is None:
            raise ValueError("estimator 'gae' needs the critic's values")
        advantages, returns = gae(kl_penalized_rewards(scores, kl, mask, penalty), values, mask, gamma, lam)
        if whiten:
            advantages = masked_whiten(advantages, mask)
    elif estimator == "reinforce_pp":
        advantages = reinforce_pp_advantages(kl_penalized_rewards(scores, kl, mask, penalty), mask, gamma,
                                             whiten=whiten)
    elif estimator == "reinforce_pp_baseline":
        advantages = reinforce_pp_baseline_advantages(scores, n, mask, kl=kl, kl_coef=penalty, gamma=gamma,
                                                      whiten=whiten)
    else:
        sequence_rewards = scores - penalty * kl.sum(-1)
        group = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}[estimator]
        advantages = broadcast_to_tokens(group(sequence_rewards, n).reshape(-1), mask)
    return advantages.masked_fill(mask == 0, 0), returns


def combine_scores(rule_scores: torch.Tensor, model_scores: list[torch.Tensor],
                   model_weights: list[float]) -> torch.Tensor:
    """One score per sample: the (already weighted) rule/remote rewards plus each reward model's weighted score."""
    total = rule_scores.float().clone()
    for scores, weight in zip(model_scores, model_weights, strict=True):
        total += weight * scores.float()
    return total


class Assembled(NamedTuple):
    """What `assemble_advantages` makes of one step's scores: the combined score per sample (batch,), the per-token
    KL estimate to the reference (batch, seq; 0 outside the responses), the advantages (batch, seq) and the critic's
    returns (batch, seq; None without a critic), and with a teacher the per-token reverse KL to it (batch, seq: log
    pi_old - log pi_teacher at each sampled token, 0 outside the responses; None without one)."""
    scores: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None
    teacher_kl: torch.Tensor | None = None


def assemble_advantages(rule_scores: torch.Tensor, model_scores: list[torch.Tensor], model_weights: list[float],
                        logps: torch.Tensor, ref_logps: torch.Tensor | None, mask: torch.Tensor, *,
                        kl_estimator: str, estimator: str, n: int, kl_coef: float = 0.0, kl_in_reward: bool = True,
                        gamma: float = 1.0, lam: float = 0.95, values: torch.Tensor | None = None,
                        whiten: bool = True, normalize_scores: bool = False, score_clip: float = 0.0,
                        teacher_logps: torch.Tensor | None = None, teacher_coef: float = 0.0) -> Assembled:
    """Advantage assembly of one RL step, from what the roles computed to what the actor and critic train on:

      1. score per sample = rule_scores (the rule and remote rewards, already weighted) + sum_m w_m * model_scores[m]
         (`combine_scores`);
      2. per-token KL of the actor (before the update, `logps`) to the reference (`ref_logps`; None without one:
         the KL is then 0) with `kl_estimator` (k1, k2, k3), 0 outside the responses;
      3. advantages and returns from them with `estimator` (`rl_advantages`, which documents the options);
      4. on-policy distillation (`teacher_logps` given): each sampled token's advantage gains
         teacher_coef * (log pi_teacher(y_t) - log pi_old(y_t)), the negative of the per-token reverse KL to the
         teacher, undiscounted and after any whitening (each token is judged by the teacher on its own; the critic's
         returns stay the rewards').

    rule_scores (batch,); model_scores one (batch,) tensor per reward model; logps, ref_logps, teacher_logps, mask
    and values (batch, seq) in the layout of `mask`. Pure: tensors in, tensors out.
    """
    scores = combine_scores(rule_scores, model_scores, model_weights)
    kl = kl_estimate(logps, logps if ref_logps is None else ref_logps, kind=kl_estimator) * mask
    advantages, returns = rl_advantages(scores, kl, mask, estimator=estimator, n=n, kl_coef=kl_coef,
                                        kl_in_reward=kl_in_reward, gamma=gamma, lam=lam, values=values, whiten=whiten,
                                        normalize_scores=normalize_scores, score_clip=score_clip)
    teacher_kl = None
    if teacher_logps is not None:
        teacher_kl = (logps - teacher_logps) * mask
        advantages = advantages - teacher_coef * teacher_kl
    return Assembled(scores, kl, advantages, returns, teacher_kl)
