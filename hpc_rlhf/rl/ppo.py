"""`hpc-rlhf ppo`: PPO with a critic, every role on its own process group (the step: rl/step.py; the keys and
their defaults: rl/config.py)."""

from __future__ import annotations

from hpc_rlhf.rl.config import Config
from hpc_rlhf.rl.step import run

__all__ = ["Config", "run"]
