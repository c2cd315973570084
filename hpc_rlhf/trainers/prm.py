"""`hpc-rlhf prm`: a process reward model, trained to tell after each step of a solution whether the steps so far
are right.

A row is a solution with a marker token (`prm.placeholder_token`) after each step and one label per step. The
model is a causal LM: at each marker, its next-token distribution over `prm.reward_tokens` ("+" for a right
step, "-" for a wrong one) is fit to the step's label by cross-entropy (algorithms.losses.process_reward_loss);
a label is a reward token, or a number in [0, 1] read as the first token's probability (soft labels, such as
the share of rollouts from that step that reached the right answer). The other positions take no loss.

The loss of an optimizer step is the mean over all its markers, whatever micro-batch or rank holds them (the
markers count as the loss tokens of the one-model loop). Logged: loss and step accuracy; on `data.eval_files`
the held-out step accuracy and loss, and the accuracy on the right and on the wrong steps apart
(`eval_right_step_accuracy`, `eval_wrong_step_accuracy`: the steps whose label favours the first reward token,
and the others; a model that calls every step right has 1 and 0).

A step's score is the probability of the first reward token at its marker: the first entry of the softmax of the
reward tokens' logits there, which `step_scores` gathers. `final/` is a causal-LM folder whose config records the
marker and the reward tokens (`process_reward`).
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.losses import process_reward_loss
from hpc_rlhf.data.examples import pad_collate, process_reward_examples, single_token_id
from hpc_rlhf.data.loading import end_later_checks, load_rows
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.models.lora import unwrap_model
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.reference import balanced_chunks
from hpc_rlhf.trainers.config import PRMConfig as Config  # the mode's keys, torch-free for --help and --dry-run
from hpc_rlhf.trainers.config import ProcessDataSection


def load_process_examples(paths, data: ProcessDataSection, tokenizer, marker_id: int, reward_tokens: list[str],
                          where: str, max_rows) -> list[dict]:
    """Rows with a solution text and its step labels -> tokenised examples (data.examples.process_reward_examples),
    each bad row named by file and line (or skipped and counted, labels that do not fit their markers too, with
    data.on_bad_row=skip)."""
    required = {data.input_key: str, data.label_key: list}
    rows, report = load_rows(paths, required=required, where=where, on_bad_row=data.on_bad_row, max_rows=max_rows)
    skipped_before = report.skipped
    columns = rows.to_dict()  # lists: iterating a dataset's rows or columns converts one value at a time
    examples = process_reward_examples(tokenizer, columns[data.input_key], columns[data.label_key],
                                       marker_id=marker_id, reward_tokens=reward_tokens, max_len=data.max_len,
                                       wheres=columns["_source"],
                                       skipped=report if data.on_bad_row == "skip" else None)
    end_later_checks(report, skipped_before, len(examples))
    return examples


def step_scores(logits: torch.Tensor, marker_positions: list[list[int]], reward_ids: list[int]) -> torch.Tensor:
    """The reward tokens' logits at every marker of a batch, rows in order: (markers, K). `logits`: (B, T, V)."""
    rows = torch.tensor([b for b, positions in enumerate(marker_positions) for _ in positions], dtype=torch.long)
    columns = torch.tensor([p for positions in marker_positions for p in positions], dtype=torch.long)
    return logits[rows.to(logits.device), columns.to(logits.device)][:, reward_ids]


class ProcessRewardRecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "prm")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.data.eval_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.marker_id = single_token_id(self.tokenizer, cfg.prm.placeholder_token, "prm.placeholder_token")
        self.reward_ids = [single_token_id(self.tokenizer, token, "prm.reward_tokens")
                           for token in cfg.prm.reward_tokens]
        load = dict(data=cfg.data, tokenizer=self.tokenizer, marker_id=self.marker_id,
                    reward_tokens=list(cfg.prm.reward_tokens))
        self.train_examples = load_process_examples(cfg.data.train_files, where="data.train_files",
                                                    max_rows=cfg.data.max_train_rows, **load)
        self.eval_examples = (load_process_examples(cfg.data.eval_files, where="data.eval_files",
                                                    max_rows=cfg.data.max_eval_rows, **load)
                              if cfg.data.eval_files else [])
        self.engine = TrainEngine(build_causal_lm(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _marker_logits(self, examples) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(reward-token logits at every marker, their targets, real tokens) of some examples, in one forward pass."""
        batch = pad_collate([{"input_ids": example["input_ids"]} for example in examples], self.tokenizer.pad_token_id)
        device = self.run.device
        logits = self.engine(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                             use_cache=False).logits
        marker_logits = step_scores(logits, [example["marker_positions"] for example in examples], self.reward_ids)
        targets = torch.tensor([t for example in examples for t in example["marker_targets"]],
                               dtype=marker_logits.dtype, device=marker_logits.device)
        return marker_logits, targets, int(batch["attention_mask"].sum())

    def _markers(self, rows: list[int]) -> int:
        return sum(len(self.train_examples[i]["marker_positions"]) for i in rows)

    def _micro_batch(self, rows: list[int]) -> loop.MicroBatch:
        marker_logits, targets, tokens = self._marker_logits([self.train_examples[i] for i in rows])
        loss, accuracy = process_reward_loss(marker_logits, targets)
        return loop.MicroBatch(loss, tokens, {"step_accuracy": accuracy}, loss_tokens=len(targets))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        self.engine.eval()
        # markers, right ones, loss sum, wrong-step markers, right ones among them
        totals = torch.zeros(5, dtype=torch.float64)
        for chunk in balanced_chunks(len(self.eval_examples), self.run.rank, self.run.world_size,
                                     self.cfg.train.micro_batch_size):
            marker_logits, targets, _ = self._marker_logits([self.eval_examples[i] for i in (chunk or [0])])
            if not chunk:
                continue  # every rank runs as many passes; this one had no rows left
            log_probs = torch.log_softmax(marker_logits.double(), dim=-1)
            right = marker_logits.argmax(-1) == targets.argmax(-1)
            wrong_step = targets.argmax(-1) != 0  # a label that does not favour the right-step token
            totals += torch.tensor([len(targets), float(right.sum()), float(-(targets * log_probs).sum()),
                                    float(wrong_step.sum()), float((right & wrong_step).sum())], dtype=torch.float64)
        self.engine.train()
        markers, right, loss, wrong_steps, right_on_wrong = run_setup.reduce_sum(totals.tolist())
        right_steps = markers - wrong_steps
        return {"eval_step_accuracy": right / markers, "eval_loss": loss / markers,
                "eval_right_step_accuracy": (right - right_on_wrong) / right_steps if right_steps else float("nan"),
                "eval_wrong_step_accuracy": right_on_wrong / wrong_steps if wrong_steps else float("nan")}

    def _row_length(self, row: int) -> int:
        return len(self.train_examples[row]["input_ids"])

    def train(self) -> dict[str, float]:
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                         micro_batch_loss=self._micro_batch, window=loop.MeanWindow(),
                                         evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                         tokenizer=self.tokenizer,
                                         loss_tokens_of=self._markers, row_length=self._row_length)
        # What a consumer needs to score steps with the saved model.
        unwrap_model(self.engine.module).config.process_reward = {
            "placeholder_token": self.cfg.prm.placeholder_token, "reward_tokens": list(self.cfg.prm.reward_tokens)}
        loop.finish_training(self.run, self.engine, self.tokenizer)
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = ProcessRewardRecipe(cfg)
    recipe.setup()
    return recipe.train()
