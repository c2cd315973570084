"""checkpoint.best_metric: the model of the best held-out evaluation so far, kept as `output_dir/best/` (a Hugging
Face folder, written as final/ is; in RL the actor), with `best.json` in it naming the figure, its value and the
step. After each evaluation of a trained step, rank 0 compares the figure with the best so far and every rank
follows its decision; a better model is written into a staging folder beside and swapped in, so that `best/` is
always one whole model. A resumed run continues from the record of `best/`; a fresh one replaces what an earlier
run left there at its first evaluation. A reward model's copy has no normalisation constants (`hpc-rlhf rm`
computes them at the end).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch.distributed as dist

from hpc_rlhf.config import ConfigError
from hpc_rlhf.dist import watchdog
from hpc_rlhf.dist.agree import decided_by
from hpc_rlhf.runtime.checkpointing import ModelToSave, save_final_model
from hpc_rlhf.runtime.run import Run

log = logging.getLogger("hpc_rlhf")

BEST_DIR = "best"
RECORD = "best.json"
_STAGING = ".best.staging"
_REPLACED = ".best.replaced"
_MAX_RECORD_BYTES = 4096  # a file in the run folder is not trusted: read a bounded amount of it


def lower_is_better(metric: str, mode: str) -> bool:
    """best_mode: "min", "max", or "auto" (lower for a loss, higher for everything else)."""
    return mode == "min" or (mode == "auto" and metric.endswith("loss"))


def beats(value: float, best: float | None, lower: bool) -> bool:
    """Whether `value` is a better figure than `best` (None: nothing yet); a nan is never better."""
    if not math.isfinite(value):
        return False
    return best is None or (value < best if lower else value > best)


def read_record(folder: Path, metric: str) -> float | None:
    """The value recorded in `folder`/best.json for `metric`, or None (no record, another figure, or a record that
    does not parse: a warning)."""
    path = folder / RECORD
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(_MAX_RECORD_BYTES + 1)[:_MAX_RECORD_BYTES])
        value = float(record["value"]) if record.get("metric") == metric else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: not a record of the best model (%s): the next evaluation replaces it", path, exc)
        return None
    return value if value is not None and math.isfinite(value) else None


def recover(output_dir: Path) -> None:
    """Finish or undo a swap that a killed job left half done: `best/` restored from the replaced folder when it is
    missing, the staging folder (an unfinished copy) removed."""
    best, replaced, staging = output_dir / BEST_DIR, output_dir / _REPLACED, output_dir / _STAGING
    if not best.exists() and (replaced / RECORD).is_file():
        replaced.rename(best)
    shutil.rmtree(replaced, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


class BestModel:
    """The best evaluation so far of one run (`checkpoint.best_metric`), and its model in `output_dir/best/`.
    Every rank makes one; only rank 0's figures count."""

    def __init__(self, run: Run):
        section = run.cfg.checkpoint
        self.run, self.metric = run, section.best_metric
        self.lower = lower_is_better(self.metric, section.best_mode) if self.metric else False
        self.best: float | None = None
        if self.metric and run.is_main:
            recover(run.output_dir)
            if run.start_step > 0:  # resumed: the best of the steps before still counts
                self.best = read_record(run.output_dir / BEST_DIR, self.metric)

    def update(self, step: int, figures: dict[str, float], model: ModelToSave | None) -> None:
        """After an evaluation (every rank; `figures` are rank 0's): check that the figure exists, and when step
        (>= 1) beats the best so far, write `model` (None on the ranks that do not hold it) as the new best."""
        if not self.metric:
            return
        missing = self.metric not in figures
        if decided_by(0, self.run.is_main and missing):
            known = ", ".join(sorted(k for k in figures if k.startswith("eval_"))) or "none on this rank"
            raise ConfigError(f"checkpoint.best_metric={self.metric}: this run's evaluation has no such figure "
                              f"(it gives: {known})")
        value = float(figures.get(self.metric, math.nan))
        if not decided_by(0, self.run.is_main and step > 0 and beats(value, self.best, self.lower)):
            return
        out = self.run.output_dir
        with watchdog.phase("checkpoint"):
            if self.run.is_main:
                shutil.rmtree(out / _STAGING, ignore_errors=True)
            dist.barrier()
            if model is not None:
                save_final_model(model.engine, out / _STAGING, model.tokenizer, model.lora)
            dist.barrier()
            if self.run.is_main:
                (out / _STAGING / RECORD).write_text(json.dumps({"metric": self.metric, "value": value,
                                                                 "step": step}) + "\n")
                if (out / BEST_DIR).exists():
                    (out / BEST_DIR).rename(out / _REPLACED)
                (out / _STAGING).rename(out / BEST_DIR)
                shutil.rmtree(out / _REPLACED, ignore_errors=True)
                self.best = value
                log.info("step %d: %s %.6g is the best so far: its model is in %s", step, self.metric, value,
                         out / BEST_DIR)
            dist.barrier()
