"""`hpc-rlhf grpo`: the critic-free RL modes (GRPO, Dr. GRPO, RLOO, REINFORCE++), the PPO recipe without a critic.

Only the defaults differ from `hpc-rlhf ppo` (rl/ppo.py): no critic in the placement, a group baseline over the
`rollout.n_samples` responses of each prompt (`rl.advantage`), the KL to the reference model as a loss term
(k3 estimator), and the tiny task's exact-match rule reward instead of a reward model.
"""

from __future__ import annotations

from hpc_rlhf.rl import step
from hpc_rlhf.rl.config import GRPOConfig as Config  # the mode's keys, torch-free for --help and --dry-run

__all__ = ["Config", "run"]


def run(cfg: Config) -> dict[str, float]:
    return step.run(cfg, mode="grpo")
