"""What a run reports: `metrics.jsonl`, TensorBoard scalars, optional Weights & Biases, a tqdm bar.

Only the rank that owns the logger writes (rank 0 by convention); every other rank gets a logger whose methods
do nothing, so trainers call it unconditionally. `metrics.jsonl` is appended to and flushed line by line: after a
crash or a preemption every logged step is on disk, and a resumed run continues the same file (rows of steps
after the resumed checkpoint are dropped first, so the file reads as one uninterrupted run).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"
logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """JSON-safe scalar: tensors and numpy scalars become floats; NaN/inf stay readable as strings."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def is_wall_clock(key: str) -> bool:
    """Whether a metrics key is a wall-clock figure (step and phase times, rates, the environments' share of the
    time): the one kind of figure that a seeded run does not repeat bit for bit."""
    return key in ("time", "env_time_share", "wall_s", "elapsed_s") or key.startswith("time_") or key.endswith("_per_s")


class MetricsError(ValueError):
    """A metrics.jsonl whose rows cannot be read back (a line in its middle is not a JSON row)."""


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `output_dir`'s metrics.jsonl. A last line that is not a JSON row was torn by a crash or a full
    disk while it was written: dropped with a warning (its step is redone from the checkpoint). One elsewhere is a
    MetricsError naming the file and the line."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif index == last:
            logger.warning("%s: its last line (%d) is not a whole JSON row (torn by a crash or a full disk): "
                           "dropped", path, index + 1)
        else:
            raise MetricsError(f"{path}, line {index + 1}: not a JSON row; the file was changed by something other "
                               f"than hpc_rlhf (move it away to start its metrics afresh)")
    return rows


def truncate_metrics(output_dir: str | Path, after_step: int) -> Path | None:
    """Drop rows logged after `after_step` (they belong to work a resume will redo). A run that starts over
    (`after_step` 0: no checkpoint, or checkpoint.resume=false) keeps the earlier run's rows: the file is moved to
    metrics.jsonl.N (the first free N), which is returned, and the new run starts an empty one."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return None
    if after_step <= 0:
        if not path.read_text(encoding="utf-8", errors="replace").strip():
            return None
        number = 1
        while path.with_name(f"{METRICS_FILE}.{number}").exists():
            number += 1
        kept = path.with_name(f"{METRICS_FILE}.{number}")
        os.replace(path, kept)
        logger.warning("%s: a run that starts over from step 0 keeps the earlier run's metrics as %s", path,
                       kept.name)
        return kept
    kept_rows = [r for r in read_metrics(output_dir) if int(r.get("step", 0)) <= after_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept_rows))
    os.replace(tmp, path)
    return None


class MetricsLogger:
    """Writes one JSON object per logged step plus TensorBoard (and W&B when asked) scalars."""

    def __init__(self, output_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 wandb: str = "off", wandb_project: str = "hpc_rlhf", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, progress_total: int | None = None,
                 progress: bool = True, initial_step: int = 0, desc: str = "train"):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self._file = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.output_dir, initial_step)
        self._file = open(self.output_dir / METRICS_FILE, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tb"), purge_step=initial_step + 1)
        if wandb != "off":
            self._wandb = _start_wandb(wandb, wandb_project, run_name or self.output_dir.name, config,
                                       self.output_dir)
        if progress and progress_total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=progress_total, initial=initial_step, desc=desc, dynamic_ncols=True,
                             mininterval=1.0)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if self._tb is not None:
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._bar is not None:
            shown = {k: v for k, v in row.items() if k in ("loss", "reward", "accuracy", "eval_accuracy", "kl", "kl_k1")}
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()},
                                  refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _start_wandb(mode: str, project: str, name: str, config, output_dir: Path):
    try:
        import wandb
    except ImportError:
        raise RuntimeError(f"log.wandb={mode} was asked for but the wandb package is not installed "
                           "(pip install wandb, or set log.wandb=off)") from None
    return wandb.init(project=project, name=name, mode=mode, dir=str(output_dir),
                      config=dict(config) if config else None)
