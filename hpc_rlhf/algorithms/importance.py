"""Off-policy corrections between the engine that sampled a batch and the trainer that learns from it.

The rollout engine samples each response from its own policy mu: other kernels and precision than the trainer's
(vLLM), and under asynchronous RL weights up to `max_staleness` steps older. The policy losses assume the samples
came from pi_old, the trainer's policy before the update, so each token carries the ratio

    rho_t = pi_old(y_t) / mu(y_t)          (old_logps from the trainer, rollout_logps from the engine)

and a whole response the sequence ratio, the product of its token ratios, summed in log space:

    rho(y) = prod_t rho_t = exp(sum_t log rho_t)

as defined for sequence-level truncated and masked importance sampling by Liu, Li et al. 2025 ("When Speed Kills
Stability: Demystifying RL Collapse from the Training-Inference Mismatch"). The sequence ratio is the one that
makes the sequence-level policy gradient unbiased; its spread grows with the response length, so its bounds are
looser in practice than token bounds.

Modes (`IS_CORRECTIONS`; `choices.resolve_is_correction` picks one from the config's keys); w are constant
per-token weights for the loss's `token_weights`:
    none       no weights, nothing dropped
    tis_token  w_t = min(rho_t, cap): token-level truncated IS (Yao et al. 2025, "Your Efficient RL Framework
               Secretly Brings You Off-Policy RL Training")
    tis_seq    w_t = min(rho(y), cap) for every token of y: sequence-level truncated IS
    mis_token  w_t = rho_t where is_low <= rho_t <= is_high; other tokens are dropped from the loss
    mis_seq    w_t = rho(y) where is_low <= rho(y) <= is_high; other responses are dropped from the loss
Masked IS keeps the importance weight of what it keeps (bounded by is_high there) and rejects the rest, rather
than truncating it: a token or answer that far off-policy says more about the engine than about the policy.
Dropped tokens leave the loss's mean too (see `losses.loss_mask`): use the returned mask for the loss and for
the step's normalizer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hpc_rlhf.algorithms.choices import IS_CORRECTIONS
from hpc_rlhf.algorithms.logprobs import _check_shapes



class ISCorrection(NamedTuple):
    """What `off_policy_correction` gives the policy loss. weights (batch, seq): constant per-token weights, 0
    outside `mask`, or None (mode "none"); mask (batch, seq) bool: the response tokens the loss keeps; masked_share
    and truncated_share (scalar tensors): the shares of the response tokens dropped, and whose weight the cap
    truncated (0 when there is no response token)."""
    weights: torch.Tensor | None
    mask: torch.Tensor
    masked_share: torch.Tensor
    truncated_share: torch.Tensor


def sequence_log_ratio(old_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho(y) = sum_t (log pi_old(y_t) - log mu(y_t)) over the response tokens of each row: (batch, seq) ->
    (batch,), in fp64 (a sum over thousands of tokens of differences near 0). Padding is never read; a row without
    response tokens gets 0 (ratio 1)."""
    _check_shapes(old_logps=old_logps, rollout_logps=rollout_logps, mask=mask)
    valid = mask != 0
    token_log_ratio = old_logps.detach().double() - rollout_logps.detach().double()
    return token_log_ratio.masked_fill(~valid, 0).sum(-1)


def _log_bound(bound: float) -> float:
    return -math.inf if bound == 0 else math.log(bound)


def _share(selected: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tokens = valid.sum().clamp(min=1)
    return ((selected & valid).sum() / tokens).to(dtype)


def _check_params(mode: str, cap: float | None, is_low: float | None, is_high: float | None) -> None:
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"mode must be one of {', '.join(IS_CORRECTIONS)}, got {mode!r}")
    truncating, masking = mode.startswith("tis_"), mode.startswith("mis_")
    if cap is not None and not truncating:
        raise ValueError(f"cap applies to tis_token and tis_seq, not {mode}")
    if (is_low is not None or is_high is not None) and not masking:
        raise ValueError(f"is_low and is_high apply to mis_token and mis_seq, not {mode}")
    if truncating and (cap is None or not 0 < cap < math.inf):
        raise ValueError(f"{mode} needs a finite cap > 0, got {cap}")
    if masking and (is_low is None or is_high is None or not 0 <= is_low < 1 < is_high < math.inf):
        raise ValueError(f"{mode} needs 0 <= is_low < 1 < is_high (finite), got is_low={is_low}, is_high={is_high}")


def off_policy_correction(old_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, mode: str, *,
                          cap: float | None = None, is_low: float | None = None,
                          is_high: float | None = None) -> ISCorrection:
    """The importance weights and the loss mask of one batch for `mode` (see the module docstring).

    old_logps (trainer, pi_old), rollout_logps (engine, mu), mask (response tokens): (batch, seq). `cap` for the
    tis modes; `is_low`, `is_high` (inclusive, 0 <= is_low < 1 < is_high; is_low = 0 means no lower bound) for the
    mis modes; the other arguments must be None (`resolve_is_correction` gives exactly the ones a mode takes).
    Nothing here carries a gradient. tis_token's weights are torch.exp(old - rollout).clamp(max=cap) on the
    response tokens, bit for bit the recipe's truncated importance sampling; truncated_share counts the tokens
    whose ratio exceeds the cap, as the recipe's `tis_clipped` does. The other modes decide in log space, so no
    ratio overflows: a sequence's weight is exp(min(log rho(y), log cap)) or a kept rho(y) <= is_high.
    Response tokens must hold finite log-probs; padding is never read.
    """
    _check_shapes(old_logps=old_logps, rollout_logps=rollout_logps, mask=mask)
    _check_params(mode, cap, is_low, is_high)
    valid = mask != 0
    dtype = old_logps.dtype
    nothing = torch.zeros((), dtype=dtype, device=old_logps.device)
    if mode == "none":
        return ISCorrection(None, valid, nothing, nothing)
    with torch.no_grad():
        old, rollout = old_logps.detach(), rollout_logps.detach()
        if mode == "tis_token":
            ratio = torch.exp(old - rollout)
            weights = ratio.clamp(max=cap).masked_fill(~valid, 0)
            return ISCorrection(weights, valid, nothing, _share(ratio > cap, valid, dtype))
        if mode == "tis_seq":
            log_rho = sequence_log_ratio(old, rollout, mask)
            truncated = log_rho > math.log(cap)
            weight = torch.exp(log_rho.clamp(max=math.log(cap))).to(dtype)
            weights = weight.unsqueeze(-1).expand_as(old).masked_fill(~valid, 0)
            return ISCorrection(weights, valid, nothing, _share(truncated.unsqueeze(-1), valid, dtype))
        low, high = _log_bound(is_low), math.log(is_high)
        if mode == "mis_token":
            log_rho = (old.double() - rollout.double()).masked_fill(~valid, 0)
        else:
            log_rho = sequence_log_ratio(old, rollout, mask).unsqueeze(-1).expand_as(old)
        inside = (log_rho >= low) & (log_rho <= high)
        kept = valid & inside
        # The clamp changes no kept value (they are <= log is_high); it keeps exp finite where the token is dropped.
        weights = torch.exp(log_rho.clamp(max=high)).to(dtype).masked_fill(~kept, 0)
        return ISCorrection(weights, kept, _share(~inside, valid, dtype), nothing)
