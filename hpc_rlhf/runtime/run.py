"""What every mode does first and logs by: run set-up (logging, seeds, output folder, the watchdog), the checks of
sizes against the model and the role, when a step logs and evaluates, and the reductions of logged figures over
ranks.

Small functions rather than a base class: each recipe (trainers/sft.py, ..., rl/step.py) calls them in its own
`setup()` and `train()`.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.config import TINY_ASSETS, ConfigError, save_config, to_dict
from hpc_rlhf.data.assets import ensure_assets, is_up_to_date
from hpc_rlhf.dist import bootstrap, groups, watchdog
from hpc_rlhf.dist.exchange import comm_device
from hpc_rlhf.models.builders import check_model_folder, read_model_config
from hpc_rlhf.utils.metrics import MetricsLogger

log = logging.getLogger("hpc_rlhf")


# ------------------------------------------------------------------------------------------------ set-up
def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def configure_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # DeepSpeed's logger is quieted where deepspeed is imported (deepspeed_compat.import_deepspeed): importing it
    # here would cost every rank 3 CPU seconds, also the ranks that never train.
    import transformers

    transformers.utils.logging.set_verbosity_error()


def uses_tiny_assets(*paths: str | Sequence[str] | None) -> bool:
    flat: list[str] = []
    for p in paths:
        if p is None:
            continue
        flat.extend([p] if isinstance(p, str) else list(p))
    return any(str(p).startswith(TINY_ASSETS) for p in flat)


def ensure_tiny_assets_if_used(*paths) -> None:
    """Generate the built-in assets (rank 0, once) when a config points into them and they are missing."""
    if not uses_tiny_assets(*paths):
        return
    if dist.get_rank() == 0 and not is_up_to_date(TINY_ASSETS):
        ensure_assets(TINY_ASSETS)
    dist.barrier()


@dataclass
class Run:
    """What a recipe knows about its process and its output folder."""
    cfg: Any
    mode: str
    output_dir: Path
    rank: int
    world_size: int
    device: torch.device
    logger: MetricsLogger | None = None
    start_step: int = 0
    # resumed from a checkpoint that a stop signal wrote at an evaluation step, whose evaluation the stop skipped
    # (its seconds went to the checkpoint): the resumed run evaluates the loaded model first, as step start_step
    eval_owed: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_run(cfg, mode: str) -> Run:
    """Common first steps of every mode: logging, seeds, output folder, saved config."""
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_logging(rank)
    # failure handling: a rank that dies or freezes ends the whole job within dist.heartbeat_timeout_s
    watchdog.start(_my_roles, watchdog.heartbeat_timeout(cfg), store_host_rank=bootstrap.store_host_rank())
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    seed_everything(cfg.train.seed if hasattr(cfg, "train") else 0)
    output_dir = Path(cfg.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, output_dir / "config.yaml")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Run(cfg=cfg, mode=mode, output_dir=output_dir, rank=rank, world_size=world, device=device)


def _my_roles() -> list[str] | None:
    """This rank's roles, once the recipe has created the role groups (what the watchdog names a rank by)."""
    return groups.my_roles() if groups.is_initialized() else None


def open_logger(run: Run, total_steps: int) -> MetricsLogger:
    cfg = run.cfg
    run.logger = MetricsLogger(run.output_dir, enabled=run.is_main, tensorboard=cfg.log.tensorboard,
                               wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project, config=to_dict(cfg),
                               progress=cfg.log.progress, progress_total=total_steps, initial_step=run.start_step,
                               desc=run.mode)
    return run.logger


def check_batch_sizes(train_cfg, role_size: int) -> None:
    per_step = train_cfg.micro_batch_size * role_size
    if train_cfg.batch_size % per_step:
        raise ConfigError(f"train.batch_size={train_cfg.batch_size} must be a multiple of train.micro_batch_size "
                          f"({train_cfg.micro_batch_size}) x ranks of the role ({role_size}) = {per_step}")


def check_fits_model(length: int, model_path: str, key: str) -> None:
    """Input validation up front: sequences of `length` tokens must fit the positions the model was built for.
    Past them, rotary models run on positions they never saw (silently worse) and learned-position models fail
    with an index error in the middle of a step. `key` names the setting that sets the length."""
    limit = getattr(read_model_config(check_model_folder(model_path)), "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ConfigError(f"{key}={length} is longer than the {limit} positions of the model in '{model_path}' "
                          f"(max_position_embeddings in its config.json); lower {key}")


# ------------------------------------------------------------------------------------------------ logging
def eval_before_training(run: Run) -> bool:
    """A fresh run (not a resumed one) evaluates once before its first step, unless log.eval_every_steps is 0."""
    return run.start_step == 0 and run.cfg.log.eval_every_steps > 0


def log_due(cfg, step: int) -> bool:
    """Whether step `step` (counted from 1) writes a metrics row: every log.every_steps and the last step."""
    return step % cfg.log.every_steps == 0 or step == cfg.train.max_steps


def eval_owed_first(run: Run) -> bool:
    """A resumed run whose checkpoint's evaluation a stop signal skipped (see Run.eval_owed) evaluates before its
    first step, at start_step."""
    return run.start_step > 0 and run.eval_owed


def eval_due(cfg, step: int) -> bool:
    """Whether a step evaluates: every log.eval_every_steps and the last step (eval_every_steps=0: only the last);
    its metrics row is written whether log.every_steps would log it or not."""
    every = cfg.log.eval_every_steps
    return (every > 0 and step % every == 0) or step == cfg.train.max_steps


def window_means(window: dict[str, list[float]]) -> dict[str, float]:
    """Each figure's mean over the micro-batches of the logging window (non-finite values left out), averaged
    over the ranks."""
    return {name: reduce_mean(mean_over(values)) for name, values in window.items()}


# ------------------------------------------------------------------------------------------------ reductions
def mean_over(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def reduce_mean(value: float, group=None) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


def reduce_sum(values: Sequence[float], group=None) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)  # on the communication device: NCCL refuses CPU tensors
    return t.tolist()


def mean_and_std(values: torch.Tensor, group=None) -> tuple[float, float]:
    """Mean and (population) standard deviation of `values` over every rank of `group`, in two passes in
    float64: the one-pass E[x^2] - E[x]^2 cancels to 0 for values such as 100 +- 0.01 in float32."""
    values = values.detach().double().reshape(-1)
    total, count = reduce_sum([float(values.sum()), values.numel()], group)
    if count == 0:
        raise ValueError("mean_and_std of no values")
    mean = total / count
    (squares,) = reduce_sum([float(((values - mean) ** 2).sum())], group)
    return mean, (squares / count) ** 0.5


