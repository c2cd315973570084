"""Pieces every training mode shares: run set-up, data order, stop policies, checkpoint save/resume, when to log
and evaluate, the final model, and the training loop of the one-model modes.

Small functions rather than a base class: each recipe (sft.py, rm.py, ...) calls them in its own `setup()` and
`train()`. The one-model recipes (sft, rm, dpo, kto; csft and rs train through sft) share one step loop,
`train_one_model`, and keep only what is their own: a micro-batch's loss and figures, and their evaluation.

Data order is a pure function of (seed, step): the rows of optimizer step `s` are positions
`s*batch_size ... (s+1)*batch_size` of an endless stream made of one seeded permutation per epoch. A resumed run
therefore needs nothing but the step number to see exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.config import TINY_ASSETS, ConfigError, save_config, to_dict
from hpc_rlhf.data.assets import ensure_assets, is_up_to_date
from hpc_rlhf.dist import bootstrap, groups, watchdog
from hpc_rlhf.dist.exchange import comm_device
from hpc_rlhf.models.builders import check_model_folder, read_model_config
from hpc_rlhf.models.lora import save_model
from hpc_rlhf.utils import checkpoint as ckpt
from hpc_rlhf.utils import faults
from hpc_rlhf.utils.metrics import MetricsLogger

log = logging.getLogger("hpc_rlhf")

TRAINER_STATE = "trainer_state.json"


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


def start_training(run: Run, engines: dict) -> tuple["NonFiniteGuard", "StopSignal"]:
    """Last set-up steps of a one-model mode, in this order: resume from the newest checkpoint (sets
    run.start_step, which the logger then starts from), a guard counting non-finite steps, the SIGUSR1/SIGTERM
    listener, the metrics logger. Returns (guard, stop signal)."""
    resume_if_possible(run, engines)
    bad_steps = NonFiniteGuard(run.cfg.train.max_bad_steps, run.mode)
    stop = StopSignal()
    open_logger(run, run.cfg.train.max_steps)
    return bad_steps, stop


# ------------------------------------------------------------------------------------------------ data order
def step_indices(num_rows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step` (pure: the same on every rank and after any resume)."""
    if num_rows <= 0:
        raise ValueError("the data set is empty")
    out: list[int] = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, num_rows)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator).tolist()
        take = min(batch_size - len(out), num_rows - offset)
        out.extend(order[offset:offset + take])
        position += take
    return out


def rank_micro_batches(indices: Sequence[int], rank: int, world: int, micro_batch_size: int) -> list[list[int]]:
    """This rank's share of a global batch, cut into micro-batches (contiguous shares, in order)."""
    if len(indices) % world:
        raise ValueError(f"a batch of {len(indices)} does not divide over {world} ranks")
    per_rank = len(indices) // world
    mine = list(indices[rank * per_rank:(rank + 1) * per_rank])
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def step_micro_batches(run: Run, num_rows: int, step: int) -> list[list[int]]:
    """This rank's micro-batches (row indices) of optimizer step `step` over `num_rows` rows, with the sizes and
    seed of run.cfg.train and the whole world as one data-parallel group."""
    train = run.cfg.train
    indices = step_indices(num_rows, train.batch_size, step, train.seed)
    return rank_micro_batches(indices, run.rank, run.world_size, train.micro_batch_size)


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


# ------------------------------------------------------------------------------------------------ stopping
class StopSignal:
    """SIGUSR1 / SIGTERM (what Slurm's --signal and preemption send) ask for a checkpoint and a clean exit.

    The handler only sets a flag; `requested(group)` makes all ranks agree (max over the group) at a step
    boundary, so every rank stops after the same step.
    """

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.received: int | None = None
        for sig in signals:
            try:
                signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self, group=None) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32, device=comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


class NonFiniteGuard:
    """Counts optimizer steps skipped for non-finite loss or gradients; too many in a row stops the run."""

    def __init__(self, max_in_a_row: int, what: str = "training"):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self.what = what

    def update(self, skipped: bool, step: int) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        log.warning("%s step %d skipped: loss or gradient not finite (%d in a row)", self.what, step,
                    self.in_a_row)
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(f"{self.what}: {self.in_a_row} optimizer steps in a row had a non-finite loss "
                                     f"or gradient (last at step {step}); stopping (train.max_bad_steps="
                                     f"{self.max_in_a_row}). Lower train.lr or check the data.")


def all_finite(value: torch.Tensor, group=None) -> bool:
    """True on every rank of `group` when the value is finite on all of them."""
    flag = torch.tensor([1.0 if bool(torch.isfinite(value.detach()).all()) else 0.0], device=comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# ------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(run: Run, step: int, engines: dict, state: dict[str, Any] | None = None,
                    save_extra: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """All ranks: every engine this rank holds saves into the staging folder, then rank 0 seals it.

    `engines` maps a name to a TrainEngine for the engines this rank takes part in; the names must be the same
    on all ranks of each engine's group. Per-rank RNG states are saved too, for exact resume. `save_extra(staging)`,
    called on every rank, writes what else the recipe keeps (e.g. the RL batches in flight) into the staging folder
    and returns entries for the trainer state (rank 0's are written): sealed by the same commit as the rest.
    """
    if run.is_main:
        ckpt.prepare_staging(run.output_dir, step)
    dist.barrier()
    staging = ckpt.staging_dir(run.output_dir, step)
    for name, engine in engines.items():
        engine.save_checkpoint(staging / name)
    rng_dir = staging / "rng"
    rng_dir.mkdir(exist_ok=True)
    torch.save(ckpt.rng_state(), rng_dir / f"rank{run.rank:05d}.pt")
    extra = save_extra(staging) if save_extra is not None else {}
    if run.is_main:
        (staging / TRAINER_STATE).write_text(json.dumps({"step": step, "mode": run.mode,
                                                         "world_size": run.world_size, **(state or {}), **extra}))
    dist.barrier()
    final = None
    if run.is_main:
        final = ckpt.commit(run.output_dir, step, keep=run.cfg.checkpoint.keep)
        log.info("checkpoint of step %d written to %s", step, final)
    dist.barrier()
    return final or ckpt.checkpoints_root(run.output_dir) / ckpt.checkpoint_name(step)


def resume_if_possible(run: Run, engines: dict) -> dict[str, Any]:
    """Load the newest complete checkpoint if resuming is on; returns its trainer state ({} when none)."""
    if not run.cfg.checkpoint.resume:
        return {}
    found = ckpt.latest_complete(run.output_dir)
    if found is None:
        return {}
    step, path = found
    state = json.loads((path / TRAINER_STATE).read_text())
    if state.get("world_size") != run.world_size:
        raise RuntimeError(f"{path} was written by a job of {state.get('world_size')} ranks; this job has "
                           f"{run.world_size}. Start with a new output_dir or checkpoint.resume=false.")
    for name, engine in engines.items():
        engine.load_checkpoint(path / name)
    rng_file = path / "rng" / f"rank{run.rank:05d}.pt"
    if rng_file.is_file():
        ckpt.set_rng_state(torch.load(rng_file, weights_only=False))
    run.start_step = step
    run.extra["resumed_from"] = path
    log.info("resumed from %s (step %d)", path, step)
    return state


def should_save(step: int, every: int, max_steps: int) -> bool:
    return step == max_steps or (every > 0 and step % every == 0)


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


# ------------------------------------------------------------------------------------------------ logging
def eval_before_training(run: Run) -> bool:
    """A fresh run (not a resumed one) evaluates once before its first step, unless log.eval_every_steps is 0."""
    return run.start_step == 0 and run.cfg.log.eval_every_steps > 0


def log_due(cfg, step: int) -> bool:
    """Whether step `step` (counted from 1) writes a metrics row: every log.every_steps and the last step."""
    return step % cfg.log.every_steps == 0 or step == cfg.train.max_steps


def eval_due(cfg, step: int) -> bool:
    """Whether a logged step evaluates: every log.eval_every_steps and the last step (eval_every_steps=0: only
    the last)."""
    every = cfg.log.eval_every_steps
    return (every > 0 and step % every == 0) or step == cfg.train.max_steps


def step_figures(info, tokens: float, seconds: float, bad_steps: "NonFiniteGuard") -> dict[str, float]:
    """The figures every mode logs after its own: the last optimizer step's learning rate and gradient norm
    (`info`, a StepInfo), the tokens (of all ranks) trained on per second of the logging window, and the number
    of steps skipped for non-finite values so far."""
    return {"lr": info.lr, "grad_norm": info.grad_norm, "tokens_per_s": tokens / max(seconds, 1e-9),
            "skipped_steps": bad_steps.total}


def window_means(window: dict[str, list[float]]) -> dict[str, float]:
    """Each figure's mean over the micro-batches of the logging window (non-finite values left out), averaged
    over the ranks."""
    return {name: reduce_mean(mean_over(values)) for name, values in window.items()}


# ------------------------------------------------------------------------------------------------ the end
def save_final_model(engine, directory: str | Path, tokenizer, lora_cfg) -> None:
    """The trained model as a Hugging Face folder that `from_pretrained` (and vLLM) load unchanged.

    LoRA models are written merged (or as an adapter folder with model.lora.merge_on_save=false). Every rank of
    the engine's group calls this.
    """
    if lora_cfg.rank > 0:
        with engine.gathered_parameters() as module:
            if engine.is_leader:
                save_model(module, directory, tokenizer=tokenizer, merge=lora_cfg.merge_on_save)
        dist.barrier(group=engine.group)
    else:
        engine.save_hf(directory, tokenizer=tokenizer)


def finish_training(run: Run, engine, tokenizer) -> None:
    """End of a one-model mode: the trained model into output_dir/final/ (see save_final_model), the logger
    closed."""
    with watchdog.phase("checkpoint"):  # failure handling: a failure while saving is reported in this phase
        save_final_model(engine, run.output_dir / "final", tokenizer, run.cfg.model.lora)
    run.logger.close()


class Preempted(SystemExit):
    """Raised after the checkpoint of a stop request is written; the launcher turns it into a requeue."""

    EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"

    def __init__(self, step: int):
        super().__init__(self.EXIT_CODE)
        self.step = step


def checkpoint_or_stop(run: Run, step: int, engines: dict, stop: "StopSignal", max_steps: int,
                       save_extra: Callable[[Path], dict[str, Any]] | None = None) -> None:
    """End of an optimizer step: checkpoint when one is due or a stop was requested (SIGUSR1/SIGTERM, agreed
    by all ranks); after a requested stop's checkpoint, raise Preempted so the job exits for requeueing.
    `save_extra`: see `save_checkpoint`."""
    stopping = stop.requested()
    if stopping or should_save(step, run.cfg.checkpoint.every_steps, max_steps):
        with watchdog.phase("checkpoint"):
            save_checkpoint(run, step, engines, save_extra=save_extra)
    if stopping:
        run.logger.close()
        raise Preempted(step)


# ------------------------------------------------------------------------------------------------ one-model loop
@dataclass
class MicroBatch:
    """What a one-model recipe computes for one micro-batch of training rows: the loss to train on, the real
    (non-padding) tokens it holds, and the recipe's own figures for its logging window (tensors or numbers, read
    after the optimizer step, as the loss is).

    `loss_tokens`: for a loss that is a mean over tokens, how many tokens this micro-batch's mean is over. The
    training loop then turns it into this micro-batch's part of the mean over every loss token of the optimizer
    step (all micro-batches, all ranks); None for a loss that is a mean over rows (pairs, examples)."""
    loss: torch.Tensor
    tokens: int
    figures: dict[str, Any] = field(default_factory=dict)
    loss_tokens: int | None = None


class FigureWindow(Protocol):
    """The figures of a logging window: `add` takes each micro-batch's figures (its "loss" and its MicroBatch
    figures); `summary` returns the window's figures, the same on every rank (a collective), and starts the
    next window."""

    def add(self, figures: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, float]: ...


class MeanWindow:
    """Each figure's mean over the micro-batches of the logging window (non-finite values left out), averaged
    over the ranks (see window_means)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, figures: dict[str, Any]) -> None:
        for name, value in figures.items():
            self.values.setdefault(name, []).append(float(value))

    def summary(self) -> dict[str, float]:
        means = window_means(self.values)
        self.values = {}
        return means


def step_share(micro_tokens: int, step_tokens: int, micro_batches_in_step: int) -> float:
    """Factor that turns a micro-batch's token-mean loss into its part of the step's token mean, as DeepSpeed
    sees it: DeepSpeed divides each backward by the accumulation steps and averages over ranks, i.e. divides by
    the number of micro-batches in the step. One Python float (exactly 1.0 for a step of one micro-batch)."""
    return micro_tokens * micro_batches_in_step / max(step_tokens, 1)


def train_one_model(run: Run, engine, *, num_rows: int, micro_batch_loss: Callable[[list[int]], MicroBatch],
                    window: FigureWindow, evaluate: Callable[[], dict[str, float]], bad_steps: NonFiniteGuard,
                    stop: StopSignal, loss_tokens_of: Callable[[list[int]], int] | None = None) -> dict[str, float]:
    """The training loop of a one-model mode, the whole world one data-parallel group; returns the last
    evaluation's figures.

    `loss_tokens_of(row indices)`, for a token-mean loss (SFT): how many loss tokens those rows hold. With it,
    each micro-batch's loss (a mean over its own `MicroBatch.loss_tokens`) is rescaled into its part of the mean
    over all loss tokens of the optimizer step, so a 2-token and a 100-token answer weigh alike per token whatever
    micro-batch or rank they land in. Every rank counts the whole step itself (the rows are known everywhere):
    no communication.

    Per optimizer step: this rank's micro-batches of `num_rows` training rows (step_micro_batches), each one's
    `micro_batch_loss(row indices)` trained on; on a logging step the window's figures, the step figures and,
    when due, `evaluate()` go to metrics.jsonl; then a checkpoint when one is due or a stop was requested.
    Failure handling: the watchdog knows the step in progress and its phase (`eval`, `training`, `checkpoint`),
    which is also where HPC_RLHF_FAULT's kill/raise/freeze faults fire, and a nan fault poisons the loss.
    """
    cfg = run.cfg
    engine.train()
    if eval_before_training(run):
        with watchdog.phase("eval"):
            run.logger.log(0, evaluate())
    last_eval: dict[str, float] = {}
    window_tokens, window_start = 0, time.perf_counter()
    for step in range(run.start_step, cfg.train.max_steps):
        done = step + 1  # steps are counted from 1, as in metrics.jsonl and checkpoint names
        watchdog.set_step(done)
        with watchdog.phase("training"):
            micro_batches = step_micro_batches(run, num_rows, step)
            step_loss_tokens = (loss_tokens_of(step_indices(num_rows, cfg.train.batch_size, step, cfg.train.seed))
                                if loss_tokens_of is not None else None)
            for rows in micro_batches:
                micro = micro_batch_loss(rows)
                loss = micro.loss
                if step_loss_tokens is not None:
                    loss = loss * step_share(micro.loss_tokens, step_loss_tokens, len(micro_batches) * run.world_size)
                loss = faults.poison(loss, done)
                engine.backward(loss)
                info = engine.step()
                window.add({"loss": loss.item(), **micro.figures})
                window_tokens += int(micro.tokens)
        bad_steps.update(info.skipped, done)
        run.logger.advance()
        if log_due(cfg, done):
            elapsed = time.perf_counter() - window_start
            tokens_all = reduce_sum([window_tokens])[0]
            metrics = {**window.summary(), **step_figures(info, tokens_all, elapsed, bad_steps)}
            if eval_due(cfg, done):
                with watchdog.phase("eval"):
                    last_eval = evaluate()
                metrics.update(last_eval)
            run.logger.log(done, metrics)
            window_tokens, window_start = 0, time.perf_counter()
        checkpoint_or_stop(run, done, {"model": engine}, stop, cfg.train.max_steps)
    return last_eval
