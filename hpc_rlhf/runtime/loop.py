"""The training loop of the one-model modes (sft, rm, dpo, kto; csft and rs train through sft): each recipe keeps
only what is its own, a micro-batch's loss and figures and its evaluation, and calls `train_one_model`.

Data order is a pure function of (seed, step) (hpc_rlhf.data.order), so a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from hpc_rlhf.data.order import rank_micro_batches, step_indices
from hpc_rlhf.dist import watchdog
from hpc_rlhf.runtime.best_model import BestModel
from hpc_rlhf.runtime.checkpointing import (ModelToSave, NonFiniteGuard, StopSignal, checkpoint_or_stop,
                                            resume_if_possible, save_final_model)
from hpc_rlhf.runtime.run import (Run, eval_before_training, eval_due, eval_owed_first, log_due, open_logger,
                                  reduce_sum, window_means)
from hpc_rlhf.utils import faults


def start_training(run: Run, engines: dict) -> tuple["NonFiniteGuard", "StopSignal"]:
    """Last set-up steps of a one-model mode, in this order: resume from the newest checkpoint (sets
    run.start_step, which the logger then starts from), a guard counting non-finite steps, the SIGUSR1/SIGTERM
    listener, the metrics logger. Returns (guard, stop signal)."""
    resume_if_possible(run, engines)
    bad_steps = NonFiniteGuard(run.cfg.train.max_bad_steps, run.mode)
    stop = StopSignal()
    open_logger(run, run.cfg.train.max_steps)
    return bad_steps, stop


def step_micro_batches(run: Run, num_rows: int, step: int,
                       row_length: Callable[[int], int] | None = None) -> list[list[int]]:
    """This rank's micro-batches (row indices) of optimizer step `step` over `num_rows` rows, with the sizes and
    seed of run.cfg.train and the whole world as one data-parallel group; with train.group_by_length, sorted by
    `row_length` (row index -> tokens) before they are cut."""
    train = run.cfg.train
    indices = step_indices(num_rows, train.batch_size, step, train.seed)
    length = row_length if train.group_by_length else None
    return rank_micro_batches(indices, run.rank, run.world_size, train.micro_batch_size, length)


def finish_training(run: Run, engine, tokenizer) -> None:
    """End of a one-model mode: the trained model into output_dir/final/ (see save_final_model), the logger
    closed."""
    with watchdog.phase("checkpoint"):  # failure handling: a failure while saving is reported in this phase
        save_final_model(engine, run.output_dir / "final", tokenizer, run.cfg.model.lora)
    run.logger.close()


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


def step_figures(info, tokens: float, seconds: float, bad_steps: NonFiniteGuard) -> dict[str, float]:
    """The figures every mode logs after its own: the last optimizer step's learning rate and gradient norm
    (`info`, a StepInfo), the tokens (of all ranks) trained on per second of the logging window, and the number
    of steps skipped for non-finite values so far."""
    return {"lr": info.lr, "grad_norm": info.grad_norm, "tokens_per_s": tokens / max(seconds, 1e-9),
            "skipped_steps": bad_steps.total}


def step_share(micro_tokens: int, step_tokens: int, micro_batches_in_step: int) -> float:
    """Factor that turns a micro-batch's token-mean loss into its part of the step's token mean, as DeepSpeed
    sees it: DeepSpeed divides each backward by the accumulation steps and averages over ranks, i.e. divides by
    the number of micro-batches in the step. One Python float (exactly 1.0 for a step of one micro-batch)."""
    return micro_tokens * micro_batches_in_step / max(step_tokens, 1)


def train_one_model(run: Run, engine, *, num_rows: int, micro_batch_loss: Callable[[list[int]], MicroBatch],
                    window: FigureWindow, evaluate: Callable[[], dict[str, float]], bad_steps: NonFiniteGuard,
                    stop: StopSignal, tokenizer=None, loss_tokens_of: Callable[[list[int]], int] | None = None,
                    row_length: Callable[[int], int] | None = None) -> dict[str, float]:
    """The training loop of a one-model mode, the whole world one data-parallel group; returns the last
    evaluation's figures.

    `loss_tokens_of(row indices)`, for a token-mean loss (SFT): how many loss tokens those rows hold. With it,
    each micro-batch's loss (a mean over its own `MicroBatch.loss_tokens`) is rescaled into its part of the mean
    over all loss tokens of the optimizer step, so a 2-token and a 100-token answer weigh alike per token whatever
    micro-batch or rank they land in. Every rank counts the whole step itself (the rows are known everywhere):
    no communication.

    `row_length(row index)`: the tokens of a training row (of a pair: its longer side), by which
    train.group_by_length sorts a rank's rows of a step before cutting its micro-batches. A step's loss is a mean
    over all its rows (or loss tokens), so the order changes no gradient but the order of float sums.

    Per optimizer step: this rank's micro-batches of `num_rows` training rows (step_micro_batches), each one's
    `micro_batch_loss(row indices)` trained on; on a logging or an evaluation step the window's figures, the step
    figures and, when due, `evaluate()` go to metrics.jsonl (with checkpoint.best_metric, a better evaluation's
    model to best/); then a checkpoint when one is due or a stop was requested (with
    checkpoint.save_hf, the model as a Hugging Face folder in it, `tokenizer` beside it). A stop skips its step's
    evaluation, which the resumed run makes first (Run.eval_owed).
    Failure handling: the watchdog knows the step in progress and its phase (`eval`, `training`, `checkpoint`),
    which is also where HPC_RLHF_FAULT's kill/raise/freeze/hang faults fire, and a nan fault poisons the loss.
    """
    cfg = run.cfg
    engine.train()
    best = BestModel(run)  # checkpoint.best_metric: the model of the best evaluation in output_dir/best/
    last_eval: dict[str, float] = {}
    if eval_before_training(run):
        with watchdog.phase("eval"):
            first = evaluate()
        run.logger.log(0, first)
        best.update(0, first, None)  # step 0 is not this run's model: only the figure's name is checked
    elif eval_owed_first(run):  # the evaluation a stop signal skipped, of the model it checkpointed
        with watchdog.phase("eval"):
            last_eval = evaluate()
        run.logger.log(run.start_step, last_eval)
        best.update(run.start_step, last_eval, ModelToSave(engine, tokenizer, cfg.model.lora))
    window_tokens, window_start = 0, time.perf_counter()
    for step in range(run.start_step, cfg.train.max_steps):
        done = step + 1  # steps are counted from 1, as in metrics.jsonl and checkpoint names
        watchdog.set_step(done)
        with watchdog.phase("training"):
            micro_batches = step_micro_batches(run, num_rows, step, row_length)
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
        # A stop signal's seconds go to the checkpoint: its step's evaluation (and best/) waits for the resumed run.
        stopping = stop.requested()
        if log_due(cfg, done) or eval_due(cfg, done):  # an evaluation step writes its row, logged or not
            elapsed = time.perf_counter() - window_start
            tokens_all = reduce_sum([window_tokens])[0]
            metrics = {**window.summary(), **step_figures(info, tokens_all, elapsed, bad_steps)}
            if eval_due(cfg, done) and not stopping:
                with watchdog.phase("eval"):
                    last_eval = evaluate()
                metrics.update(last_eval)
                best.update(done, last_eval, ModelToSave(engine, tokenizer, cfg.model.lora))
            run.logger.log(done, metrics)
            window_tokens, window_start = 0, time.perf_counter()
        checkpoint_or_stop(run, done, {"model": engine}, stopping, cfg.train.max_steps,
                           hf_models={"model": ModelToSave(engine, tokenizer, cfg.model.lora)},
                           eval_skipped=eval_due(cfg, done))
    return last_eval
