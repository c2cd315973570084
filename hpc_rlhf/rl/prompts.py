"""Phase 1 of the RL step, prompts: every rank reads the same prompt file and draws batch b's prompts from the same
seeded permutation, so no prompt is ever sent; each rollout engine then takes its contiguous share (rollout.py).
"""

from __future__ import annotations

import functools

from hpc_rlhf.data.examples import prompt_examples
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.data.order import step_indices
from hpc_rlhf.envs.transcript import Transcript
from hpc_rlhf.rl.config import Config


def load_prompts(cfg: Config, tokenizer, paths, where: str, max_rows) -> list[dict]:
    """Prompt rows as {"input_ids", "text", "answer", "row"} (answer None where the row has none; row: the data
    row, which starts an episode when there is an environment). With an environment and chat data the prompt ends
    without the assistant's turn: the episode's transcript adds it after each observation (envs/transcript.py)."""
    data = cfg.data
    rows, _ = load_rows(paths, required={data.prompt_key: str}, where=where, on_bad_row=data.on_bad_row,
                        max_rows=max_rows)
    rows = rows.to_list()  # dicts: iterating a dataset converts one value at a time
    texts = [row[data.prompt_key] for row in rows]
    if cfg.env.enabled and data.apply_chat_template:
        transcript = Transcript(tokenizer, chat=True, observation_role=cfg.env.observation_role)
        ids = [transcript.prompt_ids(text, data.max_prompt_len) for text in texts]
    else:
        ids = [example["input_ids"] for example in prompt_examples(
            tokenizer, texts, max_prompt_len=data.max_prompt_len, chat_template=data.apply_chat_template,
            wheres=[row["_source"] for row in rows])]
    out = []
    for row, text, prompt_ids in zip(rows, texts, ids):
        answer = row.get(data.answer_key)
        out.append({"input_ids": prompt_ids, "text": text, "answer": None if answer is None else str(answer),
                    "row": row})
    return out


# Round r > 0 of dynamic sampling draws its prompts from the permutation of train.seed + r * ROUND_PROMPT_SEED_OFFSET,
# far from any seed a user picks, so no round repeats another's order.
ROUND_PROMPT_SEED_OFFSET = 1_000_000_007


@functools.lru_cache(maxsize=16)  # a batch's prompts are needed at its rollout, its exchange and its scoring
def batch_rows(num_rows: int, per_batch: int, index: int, seed: int, round_index: int = 0) -> tuple[int, ...]:
    """The prompt rows of RL batch `index` (the same on every rank; each call draws a permutation of the whole
    prompt set, so it is drawn once per batch), and of its dynamic-sampling round `round_index`."""
    return tuple(step_indices(num_rows, per_batch, index, seed + round_index * ROUND_PROMPT_SEED_OFFSET))


class Prompts:
    """The prompt rows of a run and how its batches draw from them: `of(b)` are batch b's prompts (of its
    dynamic-sampling round r with `of(b, r)`), the same on every rank."""

    def __init__(self, rows: list[dict], per_step: int, n_samples: int, seed: int):
        self.rows, self.per_step, self.n_samples, self.seed = rows, per_step, n_samples, seed

    def of(self, index: int, round_index: int = 0) -> list[dict]:
        return [self.rows[i] for i in batch_rows(len(self.rows), self.per_step, index, self.seed, round_index)]

    def per_sample(self, prompts: list[dict], key: str) -> list:
        """`key` of each prompt, once per sample (prompt-major: prompt k's samples are k * n ... k * n + n - 1)."""
        return [p[key] for p in prompts for _ in range(self.n_samples)]
