"""What the round-based modes share (`rs`, `idpo`; `csft` samples once): round folders, the count of finished
rounds, sampling and scoring a round's prompts, the per-round metrics and the copy of the last model.

Round r (counted from 1) lives in `output_dir/round_<r>/`; `output_dir/rounds.json` counts the finished rounds, so
a restarted job resumes at the first unfinished round, and inside it at its first unfinished generation chunk or
training checkpoint. `metrics.jsonl` has one row per round (step = round number).

Small functions, called in order by each mode's `run()`:

    run_, prompts, done, logger = rounds.start_rounds(cfg, "rs")
    for r, round_dir in rounds.remaining_rounds(run_, done, cfg.rounds):
        records = rounds.sample_round(cfg, run_, model_path, rounds.round_prompts(prompts, per_round, r - 1), round_dir)
        ... the mode's own selection and training ...
        rounds.finish_round(run_, logger, r, figures)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import torch.distributed as dist

from hpc_rlhf.config import ConfigError
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.trainers.generate import Scorer, generate_to_file, load_policy, load_prompt_rows, read_jsonl
from hpc_rlhf.utils.metrics import MetricsLogger

ROUNDS_FILE = "rounds.json"


def round_prompts(rows: Sequence[dict], per_round: int | None, round_index: int) -> list[dict]:
    """Round r's prompts: the r-th block of `per_round` rows, wrapping around the file (all rows when None)."""
    if per_round is None or per_round >= len(rows):
        return list(rows)
    start = (round_index * per_round) % len(rows)
    return [rows[(start + i) % len(rows)] for i in range(per_round)]


def read_rounds_done(output_dir: Path) -> int:
    path = output_dir / ROUNDS_FILE
    return int(json.loads(path.read_text())["completed"]) if path.is_file() else 0


def write_rounds_done(output_dir: Path, completed: int) -> None:
    tmp = output_dir / (ROUNDS_FILE + ".tmp")
    tmp.write_text(json.dumps({"completed": completed}))
    tmp.replace(output_dir / ROUNDS_FILE)


def round_dir(run: run_setup.Run, r: int) -> Path:
    """The folder of round r (counted from 1)."""
    return run.output_dir / f"round_{r}"


def open_round_logger(run: run_setup.Run) -> MetricsLogger:
    """metrics.jsonl of a round-based mode: one row per round, no TensorBoard (the inner runs write theirs)."""
    return MetricsLogger(run.output_dir, enabled=run.is_main, tensorboard=False, progress=False,
                         initial_step=run.start_step, desc=run.mode)


def start_rounds(cfg, mode: str) -> tuple[run_setup.Run, list[dict], int, MetricsLogger]:
    """First steps of a round-based mode: the run; every prompt of data.train_files (each round takes its block of
    them, see round_prompts); the number of rounds already finished, from rounds.json (run.start_step is set to
    it); and the per-round logger."""
    run = run_setup.start_run(cfg, mode)
    run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.eval.prompt_files)
    prompts = load_prompt_rows(dataclasses.replace(cfg.data, max_train_rows=None))
    done = read_rounds_done(run.output_dir)
    run.start_step = done
    return run, prompts, done, open_round_logger(run)


def remaining_rounds(run: run_setup.Run, done: int, total: int) -> Iterator[tuple[int, Path]]:
    """(r, folder of round r) of every round after the `done` finished ones, up to `total`; r counted from 1."""
    for r in range(done + 1, total + 1):
        yield r, round_dir(run, r)


def sample_round(cfg, run: run_setup.Run, model_path: str, rows: Sequence[dict], round_dir: Path,
                 prompt_fn=None) -> list[dict] | None:
    """Generate and score `rows` with the model at `model_path` into round_dir; every rank gets the records
    (None when a per-job chunk limit stopped generation early). `prompt_fn(row) -> row` may rewrite prompts."""
    model, tokenizer = load_policy(dataclasses.replace(cfg.model, path=model_path), run.device)
    scorer = Scorer(cfg.score, cfg.model, run.device) if cfg.score.enabled else None
    if scorer is None:
        raise ConfigError("score.functions and score.reward_models are both empty: samples cannot be selected")
    rows = [prompt_fn(r) for r in rows] if prompt_fn else list(rows)
    out = generate_to_file(model, tokenizer, rows, cfg.generate, cfg.data, scorer, round_dir / "generate",
                           round_dir / "generations.jsonl")
    del model, scorer
    return read_jsonl(round_dir / "generations.jsonl") if out["complete"] else None


def finish_round(run: run_setup.Run, logger: MetricsLogger, r: int, figures: dict) -> None:
    """Round r's row in metrics.jsonl, then rounds.json counts the round as finished (rank 0); all ranks wait."""
    logger.log(r, figures)
    if run.is_main:
        write_rounds_done(run.output_dir, r)
    dist.barrier()


def copy_final(src: Path, dst: Path) -> None:
    if dist.get_rank() == 0:
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    dist.barrier()
