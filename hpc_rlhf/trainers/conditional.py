"""`hpc-rlhf csft`: conditional SFT (SteerLM-style, arXiv 2308.12050): train on responses labelled with their score.

1. Sample `generate.n` responses per prompt with the starting model and score them (resumable; see generate.py),
   or, with `csft.response_files`, score existing prompt/response rows instead (e.g. human demonstrations).
2. Put each response's score, bucketed by `csft.bucket_edges`, into its prompt through `csft.template`
   (default "<score:{score}> {prompt}"), keeping every sample, good and bad: the model learns what each score
   level looks like instead of seeing only the best answers.
3. Fine-tune on that with the SFT recipe (`output_dir/sft/`); its held-out accuracy is measured asking for the
   highest bucket (or `csft.ask_bucket`).
4. At the end, held-out exact match is measured asking for every bucket (`eval_accuracy_bucket_<b>` in
   `metrics.jsonl`), and `final/conditional.json` records the template and the bucket to ask for.

Bucket b holds scores s with edges[b-1] <= s < edges[b]; with edges [0.5] a 0/1 rule reward gives buckets 0 and 1.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from hpc_rlhf.data.examples import prompt_examples
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.data.synthetic import exact_match
from hpc_rlhf.data.templates import encode_many
from hpc_rlhf.models.builders import load_tokenizer
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.evaluation import generation_accuracy, load_eval_prompts
from hpc_rlhf.trainers import sft
from hpc_rlhf.trainers.config import ConditionalConfig as Config  # the mode's keys, torch-free for --help and --dry-run
from hpc_rlhf.trainers.generate import Scorer, load_policy, load_prompt_rows
from hpc_rlhf.trainers.rejection import sft_config_for
from hpc_rlhf.trainers.rounds import copy_final, open_round_logger, sample_round

CONDITIONAL_FILE = "conditional.json"


# ------------------------------------------------------------------------------------------------ pure parts
def score_bucket(score: float, edges: Sequence[float]) -> int:
    """Number of edges at or below the score: edges [0.5, 2] put 0.4 in 0, 0.5 in 1, 3 in 2."""
    return bisect.bisect_right(list(edges), score)


def conditional_prompt(template: str, prompt: str, bucket: int) -> str:
    return template.format(score=bucket, prompt=prompt)


def conditional_rows(records: Sequence[dict], template: str, edges: Sequence[float]) -> list[dict]:
    """Scored samples -> SFT rows whose prompt says the score bucket of their response."""
    return [{"prompt": conditional_prompt(template, r["prompt"], score_bucket(r["score"], edges)),
             "response": r["response"], "score": r["score"]} for r in records]


def _write_jsonl(rows: Sequence[dict], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def score_existing(cfg: Config, run: run_setup.Run) -> list[dict]:
    """Rows of `csft.response_files` as scored records (every rank scores all of them: rule rewards are cheap;
    reward models over a large file are better run once with `hpc-rlhf generate`-style sharding)."""
    data = cfg.data
    rows, _ = load_rows(cfg.csft.response_files, required={data.prompt_key: str, data.response_key: str},
                        where="csft.response_files", on_bad_row=data.on_bad_row, max_rows=data.max_train_rows)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    rows = rows.to_list()  # dicts: iterating a dataset converts one value at a time
    prompts = prompt_examples(tokenizer, [row[data.prompt_key] for row in rows], max_prompt_len=data.max_prompt_len,
                              chat_template=data.apply_chat_template, wheres=[row["_source"] for row in rows])
    responses = encode_many(tokenizer, [row[data.response_key] for row in rows], add_special_tokens=False)
    records, with_specials, sequences, prompt_lens = [], [], [], []
    for index, (row, prompt, response_ids) in enumerate(zip(rows, prompts, responses)):
        record = {"prompt": row[data.prompt_key], "response": row[data.response_key], "index": index, "sample": 0}
        if row.get(data.answer_key) is not None:
            record["answer"] = row[data.answer_key]
        records.append(record)
        with_specials.append(row[data.response_key] + (tokenizer.eos_token or ""))
        sequences.append(prompt["input_ids"] + response_ids + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt["input_ids"]))
    Scorer(cfg.score, cfg.model, run.device).score(records, with_specials, sequences, prompt_lens,
                                                   tokenizer.pad_token_id)
    return records


def bucket_accuracies(model_dir: Path, cfg: Config, rows: Sequence[dict], device) -> dict[str, float]:
    """Held-out exact match asking for each bucket in turn (sharded over the world)."""
    model, tokenizer = load_policy(dataclasses.replace(cfg.model, path=str(model_dir)), device)
    out = {}
    for bucket in range(cfg.csft.highest + 1):
        asked = [{**r, cfg.data.prompt_key: conditional_prompt(cfg.csft.template, r[cfg.data.prompt_key], bucket)}
                 for r in rows]
        acc = generation_accuracy(model, tokenizer, asked, prompt_key=cfg.data.prompt_key,
                                  answer_key=cfg.data.answer_key, max_prompt_len=cfg.data.max_prompt_len,
                                  max_new_tokens=cfg.eval.max_new_tokens, score=exact_match,
                                  chat_template=cfg.data.apply_chat_template)
        out[f"eval_accuracy_bucket_{bucket}"] = acc["accuracy"]
    return out


def run(cfg: Config) -> dict[str, Any]:
    cfg.csft.validate()
    run_ = run_setup.start_run(cfg, "csft")
    run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.eval.prompt_files)
    ask = cfg.csft.highest if cfg.csft.ask_bucket is None else cfg.csft.ask_bucket
    out = run_.output_dir
    logger = open_round_logger(run_)
    if cfg.csft.response_files:
        records = score_existing(cfg, run_)
    else:
        records = sample_round(cfg, run_, cfg.model.path, load_prompt_rows(cfg.data), out / "data")
        if records is None:
            return {"complete": False}
    (out / "data").mkdir(parents=True, exist_ok=True)
    data_file = out / "data" / "csft_data.jsonl"
    eval_rows = []
    if cfg.eval.prompt_files:
        eval_rows = load_eval_prompts(cfg)
    eval_file = out / "data" / f"eval_prompts_bucket_{ask}.jsonl"
    if run_.is_main:
        _write_jsonl(conditional_rows(records, cfg.csft.template, cfg.csft.bucket_edges), data_file)
        _write_jsonl([{**{k: v for k, v in r.items() if not k.startswith("_")},
                       cfg.data.prompt_key: conditional_prompt(cfg.csft.template, r[cfg.data.prompt_key], ask)}
                      for r in eval_rows], eval_file)
    dist.barrier()
    sft_cfg = sft_config_for(cfg, cfg.model.path, data_file, out / "sft")
    if eval_rows:
        sft_cfg.eval = dataclasses.replace(cfg.eval, prompt_files=[str(eval_file)])
    result = dict(sft.run(sft_cfg) or {})
    final = out / "sft" / "final"
    if run_.is_main:
        (final / CONDITIONAL_FILE).write_text(json.dumps({"template": cfg.csft.template, "ask_bucket": ask,
                                                          "bucket_edges": list(cfg.csft.bucket_edges)}))
    dist.barrier()
    if eval_rows:
        result.update(bucket_accuracies(final, cfg, eval_rows, run_.device))
    result["mean_score"] = sum(r["score"] for r in records) / len(records)
    logger.log(1, result)
    logger.close()
    copy_final(final, out / "final")
    return {"complete": True, **result}
