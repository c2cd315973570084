"""What the RL step logs, besides the trained roles' own figures (training.py) and the critic's (messages.py):
figures about a step's samples, from its Experience, and the step's timing.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.kl import kl_estimate
from hpc_rlhf.rl.batches import Experience, SampleBatch
from hpc_rlhf.rl.packed import Layout, processed_tokens, sample_lengths


def sample_figures(exp: Experience, kl_estimator: str, has_ref: bool, tis_cap: float | None,
                   recomputed: bool = True) -> dict[str, float]:
    """What is logged about a step's samples, from its Experience (on the logging rank, the actor's leader): rewards
    (the combined scores), KL of the actor to the reference per sequence (k1 and the configured estimator, by name),
    response length, how far the engines' sampling log-probs are from the actor's (`rollout_logprob_abs_diff`:
    mean over response tokens; `_max`: the largest), and with truncated importance sampling the weights
    pi_old / pi_rollout of the tokens: `tis_weight` the mean of the truncated weights the loss uses,
    `tis_weight_max` the largest weight before truncation, `tis_clipped` the share of tokens truncated (the same as
    `is_truncated_share`, which the Experience's assembly logs for every correction). Not `recomputed` (rl.old_logprobs
    other than recompute): the actor did not score the samples, so there is no gap to log, and the KL figures are
    the engines' log-probs' to the reference."""
    mask = exp.batch.action_mask
    scores = exp.scores
    figures = {"reward": scores.mean().item(), "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
               "response_length": float(sum(exp.batch.response_lens)) / len(scores)}
    if has_ref:
        for kind in dict.fromkeys(("k1", kl_estimator)):
            kl = exp.kl if kind == kl_estimator else kl_estimate(exp.old_logps, exp.ref_logps, kind=kind) * mask
            figures[f"kl_{kind}"] = kl.sum(1).mean().item()
    if not recomputed:
        return figures
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


def step_timing(t0: float, t_generate: float, t_score: float, t_train: float, t_sync: float,
                samples: int) -> dict[str, float]:
    """The phases' wall-clock times on the logging rank (with asynchronous RL `time_generate` is its wait for the
    batch at the exchange) and the step's samples per second."""
    elapsed = t_sync - t0
    return {"time_generate": t_generate - t0, "time_score": t_score - t_generate, "time_train": t_train - t_score,
            "time_sync": t_sync - t_train, "time_step": elapsed, "samples_per_s": samples / max(elapsed, 1e-9)}


def pad_share(batch: SampleBatch, micro: int, layout: Layout, micro_tokens: int = 0) -> float:
    """The share of pad tokens in a forward over the step's samples in order, `micro` at a time (or at most
    `micro_tokens` tokens: rl.micro_batch_tokens), in the layout the roles use (padded rows, or packed ones with
    rl.padding_free): what the scoring and training forwards waste."""
    lengths = sample_lengths(batch)
    return 1.0 - sum(lengths) / processed_tokens(lengths, micro, layout.padding_free, layout.row_tokens,
                                                 micro_tokens)
