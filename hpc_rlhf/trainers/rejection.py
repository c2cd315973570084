"""`hpc-rlhf rs`: rejection sampling (best-of-n fine-tuning), in rounds.

One round: sample `generate.n` responses per prompt with the current model (the resumable batch generation of
`trainers/generate.py`), score them (rule functions and/or reward models, `score.*`), keep the best one per prompt
(or the top k, or every response at or above a threshold; `select.*`), write the kept pairs as an SFT data set and,
with `sft_after=true`, fine-tune on it with the SFT recipe. The next round samples from that model, on the next
`data.max_train_rows` prompts of the file (all prompts every round when it is unset).

Everything of round r lives in `output_dir/round_<r>/` (generation chunks, `sft_data.jsonl`, the SFT run under
`sft/`); `output_dir/rounds.json` counts the finished rounds, so a restarted job resumes at the first unfinished
round, and inside it at the first unfinished chunk or SFT checkpoint. The last round's model is copied to
`output_dir/final/`; `metrics.jsonl` has one row per round (step = round number).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from hpc_rlhf.trainers import rounds, sft
from hpc_rlhf.trainers.config import STRATEGIES
from hpc_rlhf.trainers.config import RejectionConfig as Config  # the mode's keys, torch-free for --help and --dry-run


# ------------------------------------------------------------------------------------------------ pure parts
def select_samples(records: Sequence[dict], strategy: str = "best", k: int = 1, threshold: float = 0.0,
                   min_score: float | None = None) -> list[dict]:
    """Scored records (with "index", "sample", "score") -> the kept ones, in (index, rank by score) order.
    Ties keep the earlier sample, so the choice does not depend on anything but the file."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown selection strategy '{strategy}' (choices: {', '.join(STRATEGIES)})")
    by_prompt: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if "score" not in record:
            raise ValueError(f"record of prompt {record.get('index')} sample {record.get('sample')} has no score; "
                             f"set score.functions or score.reward_models")
        by_prompt[record["index"]].append(record)
    kept = []
    for index in sorted(by_prompt):
        ranked = sorted(by_prompt[index], key=lambda r: (-r["score"], r["sample"]))
        if strategy == "best":
            chosen = ranked[:1]
        elif strategy == "top_k":
            chosen = ranked[:k]
        else:
            chosen = [r for r in ranked if r["score"] >= threshold]
        kept.extend(r for r in chosen if min_score is None or r["score"] >= min_score)
    return kept


def write_sft_rows(records: Sequence[dict], path: Path, prompt_key: str, response_key: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps({prompt_key: r["prompt"], response_key: r["response"], "score": r["score"]}) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ the rounds
def sft_config_for(cfg, model_path: str, data_file: Path, output_dir: Path):
    """An SFT recipe config that trains `model_path` on `data_file` with this mode's train/eval/log sections."""
    data = dataclasses.replace(cfg.data, train_files=[str(data_file)], eval_files=[], max_train_rows=None,
                               prompt_key="prompt", response_key="response")
    return sft.Config(output_dir=str(output_dir), model=dataclasses.replace(cfg.model, path=model_path), data=data,
                      train=cfg.train, eval=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, dist=cfg.dist)


def run(cfg: Config) -> dict[str, Any]:
    run_, all_rows, done, logger = rounds.start_rounds(cfg, "rs")
    last: dict[str, Any] = {}
    model_path = (str(rounds.round_dir(run_, done) / "sft" / "final") if done and cfg.sft_after
                  else cfg.model.path)
    for r, round_dir in rounds.remaining_rounds(run_, done, cfg.rounds):
        rows = rounds.round_prompts(all_rows, cfg.data.max_train_rows, r - 1)
        records = rounds.sample_round(cfg, run_, model_path, rows, round_dir)
        if records is None:
            return {"complete": False, "round": r}
        kept = select_samples(records, cfg.select.strategy, cfg.select.k, cfg.select.threshold, cfg.select.min_score)
        if not kept:
            raise RuntimeError(f"round {r}: no sample passed the selection (select.min_score="
                               f"{cfg.select.min_score}); lower it or sample more (generate.n)")
        data_file = round_dir / "sft_data.jsonl"
        if run_.is_main:
            write_sft_rows(kept, data_file, "prompt", "response")
        dist.barrier()
        prompts = len({rec["index"] for rec in records})
        last = {"mean_score": sum(rec["score"] for rec in records) / len(records),
                "best_of_n_score": sum(rec["score"] for rec in select_samples(records)) / prompts,
                "kept": len(kept), "prompts": prompts}
        if cfg.sft_after:
            last.update(sft.run(sft_config_for(cfg, model_path, data_file, round_dir / "sft")) or {})
            model_path = str(round_dir / "sft" / "final")
        rounds.finish_round(run_, logger, r, last)
    if cfg.sft_after:
        rounds.copy_final(Path(model_path), run_.output_dir / "final")
    logger.close()
    return {"complete": True, "round": cfg.rounds, **last}
