"""`hpc-rlhf grpo`: the critic-free RL modes (GRPO, Dr. GRPO, RLOO, REINFORCE++), the PPO recipe without a critic.

Only the defaults differ from `hpc-rlhf ppo` (rl/ppo.py): no critic in the placement, a group baseline over the
`rollout.n_samples` responses of each prompt (`rl.advantage`), the KL to the reference model as a loss term
(k3 estimator), and the tiny task's exact-match rule reward instead of a reward model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpc_rlhf.config import field
from hpc_rlhf.rl import config, step
from hpc_rlhf.rl.config import RewardSection, RLSection


@dataclass
class Config(config.Config):
    output_dir: str = field("runs/grpo")
    placement: str = field("actor=1,ref=1,rollout=2", help="roles on ranks (no critic)")
    reward: RewardSection = dataclasses.field(
        default_factory=lambda: RewardSection(models=[], functions=["exact_match"]))
    rl: RLSection = dataclasses.field(
        default_factory=lambda: RLSection(advantage="grpo", kl_in_reward=False, kl_estimator="k3"))


def run(cfg: Config) -> dict[str, float]:
    return step.run(cfg, mode="grpo")
