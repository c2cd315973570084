"""`hpc-rlhf generate`: batch generation from a prompt file to a JSONL of responses, resumable, optionally scored.

Every rank of the world generates: the prompts are cut into chunks of `generate.chunk_size` and rank r takes
chunks r, r + world, r + 2*world, ... Each finished chunk is written to `output_dir/chunks/` under a temporary
name, renamed, and then given a done marker; a restarted job skips every chunk with a marker and a final merge on
rank 0 concatenates the chunks in prompt order into `generate.output_file`.

Sampling is seeded per prompt index (`generate.seed * 1_000_003 + index`), one `generate` call per prompt, so a
prompt's samples do not depend on which rank drew it, on the chunk size or on how many restarts it took: a resumed
run writes the same file as an uninterrupted one. (Greedy decoding has no randomness and runs a chunk at once.)

Each output row: {"prompt", "response", "index", "sample", "finish_reason"} plus "answer" when the prompt row has
`data.answer_key`, and with scoring (`score.functions` and/or `score.reward_models`) "scores" (one value per
scorer) and "score" (their sum). `response` is decoded without special tokens, so the file is SFT data as it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.config import ConfigError, DataSection, ModelSection
from hpc_rlhf.data.examples import pad_collate, prompt_examples
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.dist.agree import decided_by
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer, reward_model_tokenizer_problem
from hpc_rlhf.models.value_model import build_value_model, sequence_scores
from hpc_rlhf.rewards import call_reward_function, load_reward_function
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.process_rewards import ProcessRewardSpec, process_rewards, process_reward_spec
from hpc_rlhf.trainers.config import GenerateConfig as Config  # the mode's keys, torch-free for --help and --dry-run
from hpc_rlhf.trainers.config import GenerateSection, ScoreSection

log = logging.getLogger("hpc_rlhf")

CHUNK_DIR = "chunks"
MANIFEST = "manifest.json"


# ------------------------------------------------------------------------------------------------ pure parts
def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index`: independent of rank, chunking and restarts."""
    return seed * 1_000_003 + index


def chunk_bounds(num_prompts: int, chunk_size: int, chunk: int) -> tuple[int, int]:
    return chunk * chunk_size, min((chunk + 1) * chunk_size, num_prompts)


def rank_chunks(num_chunks: int, rank: int, world: int) -> list[int]:
    """Chunks of this rank: every world-th, starting at its rank."""
    return list(range(rank, num_chunks, world))


def sampling_params(gen: GenerateSection, eos_id: int) -> SamplingParams:
    return SamplingParams(n=gen.n, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                          max_new_tokens=gen.max_new_tokens, stop_token_ids=(eos_id,))


# ------------------------------------------------------------------------------------------------ scoring
class Scorer:
    """Rule functions and reward models; `score(records, texts, token ids, prompt lengths)` adds "scores" and
    "score" to each record. A process reward model (runtime/process_rewards.py) scores the steps marked in each
    response."""

    def __init__(self, cfg: ScoreSection, model_cfg: ModelSection, device: torch.device):
        self.cfg = cfg
        self.functions = [(spec, load_reward_function(spec)) for spec in cfg.functions]
        self.reward_models = []  # (folder, model, its process reward spec or None)
        policy = model_cfg.tokenizer or model_cfg.path
        tokenizer = load_tokenizer(policy) if cfg.reward_models else None
        for index, path in enumerate(cfg.reward_models):
            key = f"score.reward_models[{index}]"
            problem = reward_model_tokenizer_problem(policy, path, "model.tokenizer" if model_cfg.tokenizer
                                                     else "model.path", key)
            if problem:  # it scores the policy's token ids
                raise ConfigError(problem)
            rm_cfg = ModelSection(path=path, dtype=model_cfg.dtype, attn_implementation=model_cfg.attn_implementation)
            spec = process_reward_spec(path, tokenizer, key)
            build = build_value_model if spec is None else build_causal_lm
            self.reward_models.append((path, build(rm_cfg, for_training=False, device=device), spec))
        self.device = device

    @torch.no_grad()
    def _model_scores(self, model, spec: ProcessRewardSpec | None, sequences: list[list[int]],
                      prompt_lens: list[int], pad_id: int) -> list[float]:
        out: list[float] = []
        step = self.cfg.micro_batch_size
        for start in range(0, len(sequences), step):
            batch = pad_collate([{"input_ids": s, "labels": s} for s in sequences[start:start + step]], pad_id)
            input_ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
            if spec is None:
                scores = sequence_scores(model, input_ids, mask, normalize=self.cfg.normalize)
            else:  # the response's markers are the steps, not the prompt's
                after_prompt = torch.arange(input_ids.shape[1], device=self.device)[None, :] >= torch.tensor(
                    prompt_lens[start:start + step], device=self.device)[:, None]
                scores = process_rewards(model, input_ids, mask, after_prompt & (mask > 0), spec,
                                         self.cfg.process_aggregate)
            out.extend(scores.float().cpu().tolist())
        return out

    def score(self, records: list[dict], texts_with_specials: list[str], sequences: list[list[int]],
              prompt_lens: list[int], pad_id: int) -> None:
        columns: dict[str, list[float]] = {}
        prompts = [r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]) for r in records]
        answers = [r.get("answer") for r in records]
        for spec, fn in self.functions:
            columns[spec] = call_reward_function(fn, spec, prompts, texts_with_specials, answers)
        for path, model, process_spec in self.reward_models:
            columns[path] = self._model_scores(model, process_spec, sequences, prompt_lens, pad_id)
        for i, record in enumerate(records):
            record["scores"] = {name: values[i] for name, values in columns.items()}
            record["score"] = float(sum(values[i] for values in columns.values()))


# ------------------------------------------------------------------------------------------------ chunks
def _chunk_path(work_dir: Path, chunk: int) -> Path:
    return work_dir / CHUNK_DIR / f"chunk_{chunk:06d}.jsonl"


def _done_marker(work_dir: Path, chunk: int) -> Path:
    return work_dir / CHUNK_DIR / f"chunk_{chunk:06d}.done"


def chunk_is_done(work_dir: Path, chunk: int) -> bool:
    return _done_marker(work_dir, chunk).is_file() and _chunk_path(work_dir, chunk).is_file()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_manifest(work_dir: Path, settings: dict[str, Any]) -> None:
    """Rank 0: the chunks on disk must come from the same settings, or resuming would mix two different runs."""
    path = work_dir / CHUNK_DIR / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        before = json.loads(path.read_text())
        changed = [k for k in sorted(set(before) | set(settings)) if before.get(k) != settings.get(k)]
        if changed:
            raise ConfigError(f"{path.parent} holds chunks of a run with other settings ({', '.join(changed)}: "
                              f"{[before.get(k) for k in changed]} there, {[settings.get(k) for k in changed]} "
                              f"now); use a new output_dir or delete {path.parent}")
        return
    _write_atomic(path, json.dumps(settings, sort_keys=True))


def generate_chunk(engine: HFRolloutEngine, tokenizer, rows: Sequence[dict], first_index: int,
                   gen: GenerateSection, data: DataSection, scorer: Scorer | None) -> list[dict]:
    """Rows of one chunk of prompts (prompt-major, sample-minor)."""
    prompts = [example["input_ids"] for example in prompt_examples(
        tokenizer, [row[data.prompt_key] for row in rows], max_prompt_len=data.max_prompt_len,
        chat_template=data.apply_chat_template, wheres=[row.get("_source", "") for row in rows])]
    sampling = sampling_params(gen, tokenizer.eos_token_id)
    if sampling.greedy:
        out = engine.generate(prompts, sampling)
        responses, reasons = out.responses, out.finish_reasons
    else:
        responses, reasons = [], []
        for offset, ids in enumerate(prompts):
            seeded = dataclasses.replace(sampling, seed=prompt_seed(gen.seed, first_index + offset))
            out = engine.generate([ids], seeded)
            responses += out.responses
            reasons += out.finish_reasons
    records, with_specials, sequences, prompt_lens = [], [], [], []
    for offset, (row, ids) in enumerate(zip(rows, prompts)):
        for sample, (tokens, reason) in enumerate(zip(responses[offset], reasons[offset])):
            token_list = tokens.tolist()
            record = {"prompt": row[data.prompt_key],
                      "response": tokenizer.decode(token_list, skip_special_tokens=True),
                      "index": first_index + offset, "sample": sample, "finish_reason": reason}
            if row.get(data.answer_key) is not None:
                record["answer"] = row[data.answer_key]
            records.append(record)
            with_specials.append(tokenizer.decode(token_list, skip_special_tokens=False))
            sequences.append(list(ids) + token_list)
            prompt_lens.append(len(ids))
    if scorer is not None:
        scorer.score(records, with_specials, sequences, prompt_lens, tokenizer.pad_token_id)
    return records


def load_prompt_rows(data: DataSection, where: str = "data.train_files") -> list[dict]:
    rows, _ = load_rows(data.train_files, required={data.prompt_key: (str, list)}, where=where,
                        on_bad_row=data.on_bad_row, max_rows=data.max_train_rows)
    return rows.to_list()  # dicts: iterating a dataset converts one value at a time


def generate_to_file(model, tokenizer, rows: Sequence[dict], gen: GenerateSection, data: DataSection,
                     scorer: Scorer | None, work_dir: str | Path, output_file: str | Path) -> dict[str, Any]:
    """All ranks: generate this rank's missing chunks, then (when all chunks are done) rank 0 merges them.

    Returns {"complete", "chunks", "chunks_done", "generated_chunks"}; "complete" is False when
    `gen.max_chunks_per_job` stopped a rank before the end (a later call resumes).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    work_dir, output_file = Path(work_dir), Path(output_file)
    num_chunks = math.ceil(len(rows) / gen.chunk_size)
    settings = {"num_prompts": len(rows), "chunk_size": gen.chunk_size, "n": gen.n, "temperature": gen.temperature,
                "top_p": gen.top_p, "top_k": gen.top_k, "max_new_tokens": gen.max_new_tokens, "seed": gen.seed,
                "scorers": list(scorer.cfg.functions) + list(scorer.cfg.reward_models) if scorer else []}
    error = None
    if rank == 0:
        try:
            check_manifest(work_dir, settings)
        except ConfigError as exc:
            error = str(exc)
    if decided_by(0, error is not None):  # every rank stops on rank 0's verdict, none is left waiting
        raise ConfigError(error or f"the chunk manifest in {work_dir / CHUNK_DIR} does not match (see rank 0)")
    engine = HFRolloutEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                             max_batch_prompts=gen.chunk_size)
    todo = [c for c in rank_chunks(num_chunks, rank, world) if not chunk_is_done(work_dir, c)]
    if gen.max_chunks_per_job:
        todo = todo[:gen.max_chunks_per_job]
    for chunk in todo:
        start, end = chunk_bounds(len(rows), gen.chunk_size, chunk)
        records = generate_chunk(engine, tokenizer, rows[start:end], start, gen, data, scorer)
        _write_atomic(_chunk_path(work_dir, chunk), "".join(json.dumps(r) + "\n" for r in records))
        _write_atomic(_done_marker(work_dir, chunk), json.dumps({"rows": len(records), "rank": rank}))
    dist.barrier()
    done = sum(chunk_is_done(work_dir, c) for c in range(num_chunks))
    complete = done == num_chunks
    if complete and rank == 0:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = output_file.with_name(output_file.name + ".tmp")
        with open(tmp, "w") as out:
            for chunk in range(num_chunks):
                out.write(_chunk_path(work_dir, chunk).read_text())
        os.replace(tmp, output_file)
        log.info("wrote %d prompts x %d samples to %s", len(rows), gen.n, output_file)
    dist.barrier()
    return {"complete": complete, "chunks": num_chunks, "chunks_done": done, "generated_chunks": len(todo)}


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_policy(model_cfg: ModelSection, device: torch.device):
    tokenizer = load_tokenizer(model_cfg.tokenizer or model_cfg.path)
    return build_causal_lm(model_cfg, for_training=False, device=device), tokenizer


def run(cfg: Config) -> dict[str, Any]:
    run_ = run_setup.start_run(cfg, "generate")
    run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files)
    model, tokenizer = load_policy(cfg.model, run_.device)
    rows = load_prompt_rows(cfg.data)
    scorer = Scorer(cfg.score, cfg.model, run_.device) if cfg.score.enabled else None
    output = cfg.generate.output_file or str(run_.output_dir / "generations.jsonl")
    return generate_to_file(model, tokenizer, rows, cfg.generate, cfg.data, scorer, run_.output_dir, output)
