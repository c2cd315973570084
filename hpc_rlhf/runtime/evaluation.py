"""Held-out evaluation by generation: greedy answers scored against reference answers.

Each rank of `group` takes every world-th prompt, generates greedily, and the correct counts are summed over the
group, so the figure is the same on every rank and costs 1/world of the generation time.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.data.examples import prompt_examples
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.data.synthetic import exact_match
from hpc_rlhf.dist.exchange import comm_device
from hpc_rlhf.engines.rollout.base import SamplingParams
from hpc_rlhf.engines.rollout.hf import HFRolloutEngine


def response_texts(tokenizer, token_lists: Sequence[torch.Tensor]) -> list[str]:
    return [tokenizer.decode(ids.tolist() if hasattr(ids, "tolist") else ids, skip_special_tokens=False)
            for ids in token_lists]


@torch.no_grad()
def generation_accuracy(model, tokenizer, rows: Sequence[dict], *, prompt_key: str, answer_key: str,
                        max_prompt_len: int, max_new_tokens: int, score: Callable[[str, str], float],
                        chat_template: bool = False, group=None) -> dict[str, float]:
    """Mean `score(response_text, answer)` over `rows` with greedy decoding, sharded over `group`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = list(rows)[rank::world]
    total = torch.zeros(2, dtype=torch.float64)
    if mine:
        was_training = model.training
        model.eval()
        prompts = [example["input_ids"] for example in prompt_examples(
            tokenizer, [r[prompt_key] for r in mine], max_prompt_len=max_prompt_len, chat_template=chat_template)]
        engine = HFRolloutEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
        out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                                      stop_token_ids=(tokenizer.eos_token_id,)))
        texts = response_texts(tokenizer, [samples[0] for samples in out.responses])
        total[0] = sum(score(text, r[answer_key]) for text, r in zip(texts, mine))
        total[1] = len(mine)
        model.train(was_training)
    total = total.to(comm_device(group))  # NCCL reduces CUDA tensors only; gloo keeps it on the CPU
    dist.all_reduce(total, group=group)
    total = total.cpu()
    return {"accuracy": float(total[0] / max(total[1], 1)), "count": int(total[1])}


def load_eval_prompts(cfg) -> list[dict]:
    """Held-out prompts with reference answers for the exact-match evaluation: at most eval.max_rows rows of
    eval.prompt_files with data.prompt_key and data.answer_key ([] when eval.prompt_files is empty)."""
    if not cfg.eval.prompt_files:
        return []
    rows, _ = load_rows(cfg.eval.prompt_files, required={cfg.data.prompt_key: str, cfg.data.answer_key: str},
                        where="eval.prompt_files", on_bad_row=cfg.data.on_bad_row, max_rows=cfg.eval.max_rows)
    return rows.to_list()  # dicts: iterating a dataset converts one value at a time


def generation_exact_match(engine, tokenizer, rows: Sequence[dict], cfg) -> float:
    """Share of `rows` whose greedy answer is exactly the reference answer, with the training engine's model
    (parameters gathered under ZeRO-3; every rank of the engine's group calls this)."""
    with engine.gathered_parameters() as model:
        result = generation_accuracy(model, tokenizer, rows, prompt_key=cfg.data.prompt_key,
                                     answer_key=cfg.data.answer_key, max_prompt_len=cfg.data.max_prompt_len,
                                     max_new_tokens=cfg.eval.max_new_tokens, score=exact_match,
                                     chat_template=cfg.data.apply_chat_template)
    return result["accuracy"]
