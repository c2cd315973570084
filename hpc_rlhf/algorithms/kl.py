"""Per-token KL estimators and the KL-penalised reward of RLHF.

The policy samples y ~ pi, so the only thing known about KL(pi || pi_ref) at a token is the log-ratio of the
sampled token, log r = log pi(y_t) - log pi_ref(y_t). J. Schulman, "Approximating KL Divergence" (2020),
compares three single-sample estimators of KL(pi || pi_ref) built from it (his r is the inverse ratio
pi_ref / pi, hence the signs here):
    k1 = log r                          unbiased, high variance, negative for half the samples
    k2 = (log r)^2 / 2                  biased but low variance, never negative; its gradient is that of KL
                                        to first order, which is why it is a good in-loss penalty
    k3 = exp(-log r) - 1 + log r        unbiased and never negative (Bregman divergence of log at r)

As a loss term (tokens sampled from pi_old = pi, gradient through log pi only), the three differ in what they
optimise: grad E[k1] = E[grad log pi] = 0, so k1 in the loss adds noise and no pull towards the reference; grad
E[k2] = E[log r grad log pi] = grad KL(pi || pi_ref); grad E[k3] = E[(1 - pi_ref/pi) grad log pi]
= grad KL(pi_ref || pi). k1 is the estimator for a penalty inside the reward, where only its value counts.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.logprobs import _check_shapes

KL_KINDS = ("k1", "k2", "k3")
# |log r| beyond this is clamped by default: exp(100) in k3 overflows fp32 (inf), and a per-token KL that large
# says only that the two models disagree completely on that token.
LOG_RATIO_CLIP = 20.0


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, kind: str = "k1",
                log_ratio_clip: float | None = LOG_RATIO_CLIP) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of tokens sampled from pi.

    `kind` is one of k1, k2, k3 (see the module docstring). `log_ratio_clip` clamps log r to [-c, c] first:
    k3 contains exp(-log r), which overflows where the two models disagree badly on a rare token
    (default LOG_RATIO_CLIP = 20; None leaves it alone). Elementwise: any shape, same for both inputs.
    """
    _check_shapes(logps=logps, ref_logps=ref_logps)
    # bf16 log-probs differ in the third digit, which is the size of a typical per-token KL: subtract in fp32.
    compute = torch.float64 if logps.dtype == torch.float64 else torch.float32
    log_ratio = logps.to(compute) - ref_logps.to(compute)
    if log_ratio_clip is not None:
        if log_ratio_clip <= 0:
            raise ValueError(f"log_ratio_clip must be > 0, got {log_ratio_clip}")
        log_ratio = log_ratio.clamp(-log_ratio_clip, log_ratio_clip)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kind must be one of {', '.join(KL_KINDS)}, got {kind!r}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last marked position of each row of a (batch, seq) mask (0 for an all-masked row)."""
    marked = mask != 0
    # argmax returns the first maximum; on the reversed mask that is the last marked position.
    last = mask.shape[-1] - 1 - marked.flip(-1).int().argmax(-1)
    return torch.where(marked.any(-1), last, 0)


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float,
                         score_clip: float | None = None) -> torch.Tensor:
    """Per-token rewards of RLHF with a KL penalty (Ziegler et al. 2019; Ouyang et al. 2022, InstructGPT):

        reward_t = -beta * kl_t                 for every response token t
                 + score                        added at the response's last token

    scores (batch,) are the sequence scores (reward model or rule); kl (batch, seq) is a per-token estimate
    from `kl_estimate`; mask (batch, seq) marks the response tokens (left or right padding both work).
    `score_clip` clamps the scores to [-c, c] first, against reward-model outliers. A row without any
    response token gets no reward at all. Returns (batch, seq), 0 at masked positions.
    """
    _check_shapes(kl=kl, mask=mask)
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must have shape ({mask.shape[0]},) (one per row of mask), "
                         f"got {tuple(scores.shape)}")
    if score_clip is not None:
        if score_clip <= 0:
            raise ValueError(f"score_clip must be > 0, got {score_clip}")
        scores = scores.clamp(-score_clip, score_clip)
    rewards = (-beta * kl).masked_fill(mask == 0, 0)
    has_response = (mask != 0).any(-1)
    final_scores = torch.where(has_response, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(-1, last_token_index(mask).unsqueeze(-1), final_scores.unsqueeze(-1))
