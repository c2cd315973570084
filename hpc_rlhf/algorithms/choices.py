"""The names and defaults of the algorithms a config chooses between, and the resolution of the off-policy
correction keys: what a config validates against, without torch, so that `hpc-rlhf MODE --help` and `--dry-run`
(a login node's or a batch step's check) need none. The modules that implement the algorithms import them here.
"""

from __future__ import annotations

import math

ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")  # advantages.py
DPO_LOSS_TYPES = ("sigmoid", "ipo")  # losses.dpo_loss
POLICY_LOSSES = ("ppo", "gspo", "cispo")  # losses.py
# GSPO's clip range (Zheng et al. 2025, their experiments): the sequence ratio is a geometric mean of token ratios,
# so it stays much closer to 1 than a token ratio does, and PPO's 0.2 would clip nothing.
GSPO_CLIP_EPS = 3e-4
GSPO_CLIP_EPS_HIGH = 4e-4
GSPO_LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean")

# process_rewards.aggregate_steps: a response's reward from its steps' scores. min: a solution is as good as its
# worst step (a wrong step anywhere spoils it); product: the chance that every step is right, read as independent;
# last: the PRM's verdict after the last step; mean: partial credit.
STEP_AGGREGATIONS = ("min", "product", "last", "mean")

IS_CORRECTIONS = ("none", "tis_token", "tis_seq", "mis_token", "mis_seq")  # importance.off_policy_correction
# The truncation cap, and masked IS's upper bound, when the config sets none: 2 is the usual bound of truncated and
# masked IS in other RL systems; it bounds what one token or answer of a stale batch can weigh and leaves weights
# near 1 as they are.
DEFAULT_IS_CAP = 2.0


def resolve_is_correction(is_correction: str, tis_cap: float | None = None, max_staleness: int = 0,
                          is_low: float | None = None, is_high: float | None = None) -> tuple[str, dict[str, float]]:
    """The mode and the keyword arguments of `off_policy_correction` that the RL config keys select:

        auto       today's behaviour: tis_token with rl.tis_cap when set, else with DEFAULT_IS_CAP when batches
                   may come from older weights (rl.max_staleness >= 1), else none
        none       no correction
        tis_token, tis_seq    truncation at rl.tis_cap (DEFAULT_IS_CAP when unset)
        mis_token, mis_seq    rejection outside [rl.is_low, rl.is_high]; is_high defaults to DEFAULT_IS_CAP and
                              is_low to 1 / is_high (symmetric in log space: a ratio and its inverse are equally
                              far off-policy)

    A key that the chosen mode does not use is refused, naming both keys, rather than silently ignored.
    Returns (mode, params) for `off_policy_correction(old, rollout, mask, mode, **params)`.
    """
    choices = ("auto",) + IS_CORRECTIONS
    if is_correction not in choices:
        raise ValueError(f"rl.is_correction must be one of {', '.join(choices)}, got {is_correction!r}")
    if max_staleness < 0:
        raise ValueError(f"rl.max_staleness must be >= 0, got {max_staleness}")
    if tis_cap is not None and not 0 < tis_cap < math.inf:
        raise ValueError(f"rl.tis_cap must be > 0 and finite, got {tis_cap}")
    masking = is_correction.startswith("mis_")
    if tis_cap is not None and (masking or is_correction == "none"):
        raise ValueError(f"rl.tis_cap={tis_cap} truncates importance weights, which rl.is_correction={is_correction} "
                         f"does not do: unset rl.tis_cap, or use rl.is_correction=tis_token or tis_seq")
    if (is_low is not None or is_high is not None) and not masking:
        raise ValueError(f"rl.is_low/rl.is_high bound masked importance sampling, which "
                         f"rl.is_correction={is_correction} does not do: unset them, or use rl.is_correction=mis_token "
                         f"or mis_seq")
    if is_correction == "auto":
        if tis_cap is not None:
            return "tis_token", {"cap": float(tis_cap)}
        return ("tis_token", {"cap": DEFAULT_IS_CAP}) if max_staleness >= 1 else ("none", {})
    if is_correction == "none":
        return "none", {}
    if not masking:
        return is_correction, {"cap": DEFAULT_IS_CAP if tis_cap is None else float(tis_cap)}
    high = DEFAULT_IS_CAP if is_high is None else float(is_high)
    low = 1.0 / high if is_low is None else float(is_low)
    if not 0 <= low < 1 < high < math.inf:
        raise ValueError(f"rl.is_correction={is_correction} needs 0 <= rl.is_low < 1 < rl.is_high (finite), got "
                         f"rl.is_low={low}, rl.is_high={high}")
    return is_correction, {"is_low": low, "is_high": high}
