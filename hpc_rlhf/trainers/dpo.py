"""`hpc-rlhf dpo`: direct preference optimisation on chosen/rejected pairs: DPO, IPO and cDPO.

The policy starts from `model.path` (usually an SFT output) and is pushed to raise log pi(chosen) - log
pi(rejected) relative to a frozen reference (the initial policy; `ref.mode`, see runtime/reference.py).
`dpo.loss_type=sigmoid` is DPO (with `dpo.label_smoothing` > 0, cDPO), `ipo` is IPO, which compares
length-averaged log-probs. `dpo.sft_weight` > 0 adds that multiple of the NLL of the chosen responses, as some
recipes do to keep the chosen answers' likelihood from falling.

Each micro-batch of B pairs is one policy forward pass over 2B rows (chosen then rejected). Logged: loss,
accuracy (share of pairs whose implied reward beta * log(pi / ref) is higher for the chosen answer), margin (mean
chosen minus rejected reward), the mean chosen and rejected rewards; on `data.eval_files` the same accuracy,
margin and loss (eval_accuracy, eval_margin, eval_loss) and, with `eval.prompt_files`, the exact-match accuracy of
greedy answers (eval_exact_match).
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.losses import dpo_loss
from hpc_rlhf.data.examples import pair_collate
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.evaluation import generation_exact_match, load_eval_prompts
from hpc_rlhf.runtime.reference import MEAN, SUM, Reference, balanced_chunks, response_logps
from hpc_rlhf.trainers.config import DPOConfig as Config  # the mode's keys, torch-free for --help and --dry-run
from hpc_rlhf.trainers.rm import load_preference_examples


def pair_sequences(example: dict) -> list[dict]:
    """The two scored sequences of a preference pair, in pair_collate's order (chosen, rejected)."""
    return [{"input_ids": example[f"{side}_input_ids"], "labels": example[f"{side}_labels"]}
            for side in ("chosen", "rejected")]


class DPORecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "dpo")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.ref.path, cfg.data.train_files, cfg.data.eval_files,
                                          cfg.eval.prompt_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.train_examples = load_preference_examples(cfg.data.train_files, cfg.data, self.tokenizer,
                                                       "data.train_files", cfg.data.max_train_rows)
        self.eval_examples = (load_preference_examples(cfg.data.eval_files, cfg.data, self.tokenizer,
                                                       "data.eval_files", cfg.data.max_eval_rows)
                              if cfg.data.eval_files else [])
        self.eval_prompts = load_eval_prompts(cfg)
        self.engine = TrainEngine(build_causal_lm(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        self.reference = Reference(cfg.ref, cfg.model, cfg.train, self.tokenizer.pad_token_id, run.device)
        self.reference.prepare({"train": [pair_sequences(ex) for ex in self.train_examples],
                                "eval": [pair_sequences(ex) for ex in self.eval_examples]})
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _collate(self, pairs) -> dict[str, torch.Tensor]:
        batch = pair_collate(pairs, self.tokenizer.pad_token_id)
        return {k: batch[k].to(self.run.device) for k in ("input_ids", "attention_mask", "labels")}

    def _pair_loss(self, split: str, rows: list[int], examples: list[dict]) -> dict[str, torch.Tensor]:
        """The loss of B pairs and its figures; one policy forward pass over the 2B rows."""
        dpo = self.cfg.dpo
        batch = self._collate([examples[i] for i in rows])
        logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             use_cache=False).logits
        policy = response_logps(logits, batch["labels"])
        reference = self.reference.logps(split, rows, batch)
        column = MEAN if dpo.loss_type == "ipo" else SUM
        b = len(rows)
        loss, chosen_rewards, rejected_rewards = dpo_loss(
            policy[:b, column], policy[b:, column], reference[:b, column], reference[b:, column], beta=dpo.beta,
            loss_type=dpo.loss_type, label_smoothing=dpo.label_smoothing)
        if dpo.sft_weight:
            chosen_tokens = (batch["labels"][:b, 1:] != -100).sum().clamp(min=1)
            loss = loss - dpo.sft_weight * policy[:b, SUM].sum() / chosen_tokens
        return {"loss": loss, "chosen_reward": chosen_rewards, "rejected_reward": rejected_rewards,
                "tokens": batch["attention_mask"].sum()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        out: dict[str, float] = {}
        self.engine.eval()
        if self.eval_examples:
            totals = torch.zeros(4, dtype=torch.float64)  # correct, margin sum, loss sum, pairs
            for chunk in balanced_chunks(len(self.eval_examples), self.run.rank, self.run.world_size,
                                         self.cfg.train.micro_batch_size):
                figures = self._pair_loss("eval", chunk or [0], self.eval_examples)
                if chunk:
                    margin = (figures["chosen_reward"] - figures["rejected_reward"]).double().cpu()
                    totals += torch.tensor([float((margin > 0).sum()), float(margin.sum()),
                                            figures["loss"].item() * len(chunk), len(chunk)], dtype=torch.float64)
            correct, margin_sum, loss_sum, count = run_setup.reduce_sum(totals.tolist())
            out.update(eval_accuracy=correct / count, eval_margin=margin_sum / count, eval_loss=loss_sum / count)
        if self.eval_prompts:
            out["eval_exact_match"] = generation_exact_match(self.engine, self.tokenizer, self.eval_prompts, self.cfg)
        self.engine.train()
        return out

    def _micro_batch(self, rows: list[int]) -> loop.MicroBatch:
        figures = self._pair_loss("train", rows, self.train_examples)
        chosen, rejected = figures["chosen_reward"], figures["rejected_reward"]
        return loop.MicroBatch(figures["loss"], int(figures["tokens"]), {
            "accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()})

    def _pair_length(self, row: int) -> int:
        """A pair's padded length in a micro-batch (train.group_by_length): its longer side."""
        pair = self.train_examples[row]
        return max(len(pair["chosen_input_ids"]), len(pair["rejected_input_ids"]))

    def train(self) -> dict[str, float]:
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                           micro_batch_loss=self._micro_batch, window=loop.MeanWindow(),
                                           evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                           tokenizer=self.tokenizer,
                                           row_length=self._pair_length)
        loop.finish_training(self.run, self.engine, self.tokenizer)
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = DPORecipe(cfg)
    recipe.setup()
    return recipe.train()
