"""Checkpoints and stopping, the same for every mode: SIGUSR1/SIGTERM (Slurm's --signal, preemption) ask for a
checkpoint and a clean exit that the launcher requeues; checkpoints are atomic (staged; every rank fsyncs and
checksums a share of the files; rank 0 writes the marker and renames) and a resumed run continues exactly (engines,
optimizer, RNG states, the recipe's own state); a resume that finds checkpoints of which none verifies refuses
(CheckpointError, exit 2) rather than start over; too many non-finite steps in a row stop a run; the final model
is written as a Hugging Face folder, and with checkpoint.save_hf each scheduled checkpoint holds such a folder of
every trained model too (`<checkpoint>/hf/<name>`: a step's model to evaluate or serve, sealed and pruned with the
checkpoint). A reward model's copy has no normalisation constants: `hpc-rlhf rm` computes them at the end.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpc_rlhf.config import ConfigError
from hpc_rlhf.dist import watchdog
from hpc_rlhf.models.lora import save_model
from hpc_rlhf.dist.agree import any_rank
from hpc_rlhf.runtime.run import Run, seed_everything
from hpc_rlhf.utils import checkpoint as ckpt

log = logging.getLogger("hpc_rlhf")

TRAINER_STATE = "trainer_state.json"
HF_FOLDER = "hf"  # checkpoint.save_hf: <checkpoint>/hf/<name>, a Hugging Face folder of each trained model
EVAL_OWED = "eval_owed"  # trainer state: a stop signal skipped this step's evaluation (Run.eval_owed)


@dataclass(frozen=True)
class ModelToSave:
    """What a trained model's Hugging Face folder is written from (save_final_model): its engine, the tokenizer
    saved beside it, and its LoRA settings (merged or the adapter alone)."""
    engine: Any
    tokenizer: Any
    lora: Any


class CheckpointError(ConfigError):
    """checkpoint.resume=true found checkpoints but cannot use any: bad input in output_dir (exit 2), which a
    fresh start would paper over by training from step 0."""


# ------------------------------------------------------------------------------------------------ stopping
class StopSignal:
    """SIGUSR1 / SIGTERM (what Slurm's --signal and preemption send) ask for a checkpoint and a clean exit.

    The handler only sets `received`; the ranks agree at a step boundary (`requested()`, or the RL step's one
    `any_rank` per step), so every rank stops after the same step.
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
        """Whether any rank of `group` received a stop signal (a collective)."""
        return any_rank([self.received is not None], group)[0]


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



# ------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(run: Run, step: int, engines: dict, state: dict[str, Any] | None = None,
                    save_extra: Callable[[Path], dict[str, Any]] | None = None,
                    hf_models: dict[str, ModelToSave] | None = None) -> Path:
    """All ranks: every engine this rank holds saves into the staging folder; each rank fsyncs and checksums a
    share of the files; rank 0 writes the marker and moves the folder into place.

    `engines` maps a name to a TrainEngine for the engines this rank takes part in; the names must be the same
    on all ranks of each engine's group. Per-rank RNG states are saved too, for exact resume. `save_extra(staging)`,
    called on every rank, writes what else the recipe keeps (e.g. the RL batches in flight) into the staging folder
    and returns entries for the trainer state (rank 0's are written): sealed by the same commit as the rest.
    `hf_models` (checkpoint.save_hf): the trained models this rank takes part in, each written as a Hugging Face
    folder `hf/<name>` of the checkpoint, as final/ is.
    """
    if run.is_main:
        ckpt.prepare_staging(run.output_dir, step)
    dist.barrier()
    staging = ckpt.staging_dir(run.output_dir, step)
    for name, engine in engines.items():
        engine.save_checkpoint(staging / name)
    for name, model in (hf_models or {}).items():
        save_final_model(model.engine, staging / HF_FOLDER / name, model.tokenizer, model.lora)
    rng_dir = staging / "rng"
    rng_dir.mkdir(exist_ok=True)
    # The seed and the rank count beside the states: a resume on another number of ranks derives each rank's
    # state from them (restore_rng), one on the same ranks restores the states bit for bit.
    torch.save({**ckpt.rng_state(), "seed": run_seed(run), "world_size": run.world_size},
               rng_dir / f"rank{run.rank:05d}.pt")
    extra = save_extra(staging) if save_extra is not None else {}
    if run.is_main:
        (staging / TRAINER_STATE).write_text(json.dumps({"step": step, "mode": run.mode,
                                                         "world_size": run.world_size, **(state or {}), **extra}))
    dist.barrier()
    checksums = _seal_my_share(run, step)
    final = None
    if run.is_main:
        final = ckpt.commit(run.output_dir, step, keep=run.cfg.checkpoint.keep, checksums=checksums)
        log.info("checkpoint of step %d written to %s", step, final)
    dist.barrier()
    return final or ckpt.checkpoints_root(run.output_dir) / ckpt.checkpoint_name(step)


def _seal_my_share(run: Run, step: int) -> dict[str, str] | None:
    """Every rank fsyncs and checksums its share of the staging folder's files (rank 0's listing, so that a rank
    whose view of a shared file system lags does not split them otherwise); rank 0 gets every checksum."""
    listing = [ckpt.file_sizes(run.output_dir, step) if run.is_main else None]
    dist.broadcast_object_list(listing, src=0)
    mine = ckpt.seal_files(ckpt.staging_dir(run.output_dir, step), ckpt.share(listing[0], run.rank, run.world_size))
    gathered = [None] * run.world_size if run.is_main else None
    dist.gather_object(mine, gathered, dst=0)
    return {name: value for part in gathered for name, value in part.items()} if run.is_main else None


def resume_if_possible(run: Run, engines: dict) -> dict[str, Any]:
    """Load the newest checkpoint that verifies if resuming is on; returns its trainer state ({} when there is no
    checkpoint). Checkpoints of which none verifies raise CheckpointError."""
    if not run.cfg.checkpoint.resume:
        return {}
    found = choose_checkpoint(run)
    if found is None:
        return {}
    step, path = found
    state = json.loads((path / TRAINER_STATE).read_text())
    written_by = state.get("world_size")
    for name, engine in engines.items():
        try:
            # On another number of ranks each engine reshards its own state (engines/train.py, engines/reshard.py)
            engine.load_checkpoint(path / name)
        except ValueError as exc:  # what the engine cannot reshard: one line, exit 2, nothing written
            raise CheckpointError(f"checkpoint.resume=true: {path} was written by a job of {written_by} ranks; this "
                                  f"job has {run.world_size}, and the {name} cannot follow: {exc}. Run on "
                                  f"{written_by} ranks, or start over with a new output_dir or "
                                  "checkpoint.resume=false.") from None
    restore_rng(run, path, step)
    run.start_step = step
    run.eval_owed = bool(state.get(EVAL_OWED, False))
    run.extra["resumed_from"] = path
    if written_by == run.world_size:
        log.info("resumed from %s (step %d)", path, step)
    else:  # the data order depends on the step and train.batch_size only (data/order.py): it carries over exactly
        log.info("resumed from %s (step %d): resumed step %d written by %s ranks on %d", path, step, step, written_by,
                 run.world_size)
    return state


def choose_checkpoint(run: Run) -> tuple[int, Path] | None:
    """The newest candidate (ckpt.candidates: rank 0's listing) that verifies on every rank, each rank checking
    its share of the files (sizes and checksums), so that no rank reads the whole checkpoint. None when there is
    no candidate; CheckpointError, naming each folder and why it failed, when none verifies."""
    listing = [[(step, str(path)) for step, path in ckpt.candidates(run.output_dir)] if run.is_main else None]
    dist.broadcast_object_list(listing, src=0)
    problems = []
    for step, name in listing[0]:
        path = Path(name)
        info, problem = ckpt.read_marker(path)
        if problem is None:
            problem = ckpt.verify(path, names=ckpt.share(info["files"], run.rank, run.world_size))
        everyone = [None] * run.world_size
        dist.all_gather_object(everyone, problem)
        problem = next((p for p in everyone if p), None)
        if problem is None:
            return step, path
        if run.is_main:
            log.warning("skipping incomplete or corrupt checkpoint: %s", problem)
        problems.append(problem)
    if problems:
        raise CheckpointError(f"checkpoint.resume=true: no checkpoint in {ckpt.checkpoints_root(run.output_dir)} "
                              f"verifies ({'; '.join(problems)}); move the folders away, or start over with "
                              f"checkpoint.resume=false (the metrics so far are kept as metrics.jsonl.N)")
    return None


def run_seed(run) -> int:
    """The seed start_run seeded every generator with."""
    return getattr(getattr(run.cfg, "train", None), "seed", 0)


def restore_rng(run, path: Path, step: int) -> None:
    """This rank's random generators as the checkpoint in `path` left them, read with weights_only: a file in the
    run folder is not trusted code (plain tensors and numbers only). One that needs code to load is not loaded (a
    warning). When the states cannot be restored (such a file, none for this rank, or one written by a job of
    another number of ranks), this rank's are derived from the saved seed, the step and the rank: reproducible,
    but not bit for bit the uninterrupted run."""
    saved = _load_rng(path / "rng" / f"rank{run.rank:05d}.pt")
    if saved is not None and saved.get("world_size", run.world_size) == run.world_size:
        ckpt.set_rng_state(saved)
        return
    seed = (saved or _load_rng(path / "rng" / f"rank{0:05d}.pt") or {}).get("seed", run_seed(run))
    seed_everything(ckpt.derived_seed(int(seed), step, run.rank))
    log.warning("%s: the random generators' states of rank %d are derived from the seed %d and step %d, not "
                "restored (saved by %s ranks, this job has %d): the resumed run is not bit for bit the "
                "uninterrupted one", path, run.rank, seed, step, (saved or {}).get("world_size", "?"),
                run.world_size)


def _load_rng(rng_file: Path) -> dict | None:
    if not rng_file.is_file():
        return None
    try:
        return torch.load(rng_file, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ... by version
        log.warning("%s: the random generators' state is not plain tensors and numbers (a checkpoint of an older "
                    "hpc_rlhf, or a file put there): not loaded (%s)", rng_file,
                    (str(exc).splitlines() or [""])[0][:200])
        return None


def should_save(step: int, every: int, max_steps: int) -> bool:
    return step == max_steps or (every > 0 and step % every == 0)


class Preempted(SystemExit):
    """Raised after the checkpoint of a stop request is written; the launcher turns it into a requeue."""

    EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"

    def __init__(self, step: int):
        super().__init__(self.EXIT_CODE)
        self.step = step


def checkpoint_or_stop(run: Run, step: int, engines: dict, stopping: bool, max_steps: int,
                       save_extra: Callable[[Path], dict[str, Any]] | None = None,
                       hf_models: dict[str, ModelToSave] | None = None, eval_skipped: bool = False) -> None:
    """End of an optimizer step: checkpoint when one is due or `stopping` (a stop signal somewhere, agreed by all
    ranks: `StopSignal.requested`); after a stop's checkpoint, raise Preempted so the job exits for requeueing.
    `save_extra`: see `save_checkpoint`. `hf_models`: written into a checkpoint of checkpoint.every_steps when
    checkpoint.save_hf is on; not into one only a stop signal asked for (the job has seconds left to write it)
    nor at the last step (final/ is that model). `eval_skipped`: the stop skipped this step's evaluation, which
    the checkpoint records for the resumed run (Run.eval_owed)."""
    due = should_save(step, run.cfg.checkpoint.every_steps, max_steps)
    if stopping or due:
        copies = hf_models if due and step < max_steps and run.cfg.checkpoint.save_hf else None
        state = {EVAL_OWED: True} if stopping and eval_skipped else None
        with watchdog.phase("checkpoint"):
            save_checkpoint(run, step, engines, state=state, save_extra=save_extra, hf_models=copies)
    if stopping:
        run.logger.close()
        raise Preempted(step)


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


