"""`hpc-rlhf rm`: a reward model trained on chosen/rejected pairs with the Bradley-Terry loss.

The reward model is a causal-LM body with a scalar head at every position (hpc_rlhf.models.value_model); a
sequence's reward is the head's value at its last real token. Started from a causal-LM folder (the SFT output or
the tiny model) the head is new. Each micro-batch of B pairs is one forward pass over 2B rows, the B chosen rows
then the B rejected ones (with `rm.share_prompt`, over B rows that hold each prompt once: the same scores for the
prompt's tokens once; hpc_rlhf.data.examples.shared_prompt_pair_collate), and the loss is
-log sigmoid(r_chosen - r_rejected - margin), the margin read from `rm.margin_key` when set (Llama 2). Held-out
figures on `data.eval_files`: pairwise accuracy (share of pairs with r_chosen > r_rejected), mean margin
r_chosen - r_rejected, and the loss.

At the end the mean and standard deviation of the rewards of the held-out sequences (chosen and rejected) are
stored in the model's config (`reward_mean`, `reward_std`), so that a consumer (PPO) can normalise rewards with
the constants the model was saved with; `final/` loads with `AutoModelForTokenClassification.from_pretrained`.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.losses import pairwise_reward_loss
from hpc_rlhf.config import DataSection
from hpc_rlhf.data.examples import pair_collate, preference_examples, shared_prompt_pair_collate
from hpc_rlhf.data.loading import load_rows
from hpc_rlhf.dist import watchdog
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import load_tokenizer
from hpc_rlhf.models.lora import unwrap_model, value_head_name
from hpc_rlhf.models.value_model import (build_value_model, sequence_scores, set_reward_normalization,
                                         token_values)
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.reference import balanced_chunks
from hpc_rlhf.trainers.config import RMConfig as Config  # the mode's keys, torch-free for --help and --dry-run


def load_preference_examples(paths, data: DataSection, tokenizer, where: str, max_rows, margin_key: str | None = None):
    """Rows with prompt/chosen/rejected (and a numeric margin when `margin_key` is set) -> tokenised pairs,
    each bad row named by file and line."""
    required = {data.prompt_key: str, data.chosen_key: str, data.rejected_key: str}
    if margin_key:
        required[margin_key] = float
    rows, _ = load_rows(paths, required=required, where=where, on_bad_row=data.on_bad_row, max_rows=max_rows)
    columns = rows.to_dict()  # lists: iterating a dataset's rows or columns converts one value at a time
    examples = preference_examples(tokenizer, columns[data.prompt_key], columns[data.chosen_key],
                                   columns[data.rejected_key], max_len=data.max_len, max_prompt_len=data.max_prompt_len,
                                   chat_template=data.apply_chat_template, wheres=columns["_source"])
    if margin_key:
        for example, margin in zip(examples, columns[margin_key]):
            example["margin"] = float(margin)
    return examples


class EngineScorer:
    """What `value_model.sequence_scores` needs from a model, served by the training engine: calling it runs
    the engine's forward (which keeps DeepSpeed's collectives in the engine's group), and `score` / `config`
    are the wrapped model's head and config (the head's per-token output is caught on its way out)."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def __call__(self, **batch):
        return self.engine(**batch)

    @property
    def score(self) -> torch.nn.Module:
        return getattr(unwrap_model(self.engine.module), value_head_name(self.engine.module))

    @property
    def config(self):
        return unwrap_model(self.engine.module).config


class RewardModelRecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "rm")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.data.eval_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        margin_key = cfg.rm.margin_key
        self.train_examples = load_preference_examples(cfg.data.train_files, cfg.data, self.tokenizer,
                                                       "data.train_files", cfg.data.max_train_rows, margin_key)
        self.eval_examples = (load_preference_examples(cfg.data.eval_files, cfg.data, self.tokenizer,
                                                       "data.eval_files", cfg.data.max_eval_rows, margin_key)
                              if cfg.data.eval_files else [])
        self.engine = TrainEngine(build_value_model(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        self.scorer = EngineScorer(self.engine)
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _pair_scores(self, pairs) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(chosen scores, rejected scores, real tokens) of B pairs, in one forward pass."""
        device = self.run.device
        if self.cfg.rm.share_prompt:
            batch = shared_prompt_pair_collate(pairs, self.tokenizer.pad_token_id)
            values = token_values(self.scorer, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                  position_ids=batch["position_ids"].to(device))
            rows = torch.arange(len(pairs), device=values.device)
            return (values[rows, batch["chosen_last"].to(values.device)],
                    values[rows, batch["rejected_last"].to(values.device)], batch["tokens"])
        batch = pair_collate(pairs, self.tokenizer.pad_token_id)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        scores = sequence_scores(self.scorer, ids, mask)
        return scores[:len(pairs)], scores[len(pairs):], int(batch["attention_mask"].sum())

    def _loss(self, pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        chosen, rejected, tokens = self._pair_scores(pairs)
        margin = None
        if self.cfg.rm.margin_key:
            margin = torch.tensor([p["margin"] for p in pairs], dtype=chosen.dtype, device=chosen.device)
        loss, accuracy = pairwise_reward_loss(chosen, rejected, margin)
        return loss, accuracy, (chosen - rejected).detach().mean(), tokens

    @torch.no_grad()
    def _held_out_scores(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of `examples` scored: (chosen, rejected). Every rank runs as many passes."""
        chosen, rejected = [], []
        chunks = balanced_chunks(len(examples), self.run.rank, self.run.world_size, self.cfg.train.micro_batch_size)
        for chunk in chunks:
            c, r, _ = self._pair_scores([examples[i] for i in (chunk or [0])])
            if chunk:
                chosen.append(c.double().cpu())
                rejected.append(r.double().cpu())
        empty = torch.zeros(0, dtype=torch.float64)
        return torch.cat(chosen) if chosen else empty, torch.cat(rejected) if rejected else empty

    def evaluate(self) -> dict[str, float]:
        if not self.eval_examples:
            return {}
        self.engine.eval()
        chosen, rejected = self._held_out_scores(self.eval_examples)
        self.engine.train()
        difference = chosen - rejected
        if self.cfg.rm.margin_key:
            rows = list(range(self.run.rank, len(self.eval_examples), self.run.world_size))
            margins = torch.tensor([self.eval_examples[i]["margin"] for i in rows], dtype=torch.float64)
        else:
            margins = torch.zeros_like(difference)
        losses = -torch.nn.functional.logsigmoid(difference - margins)
        correct, total_margin, total_loss, count = run_setup.reduce_sum(
            [float((difference > 0).sum()), float(difference.sum()), float(losses.sum()), len(difference)])
        return {"eval_accuracy": correct / count, "eval_margin": total_margin / count, "eval_loss": total_loss / count}

    def normalization_constants(self) -> tuple[float, float]:
        """Mean and standard deviation of the rewards of every held-out sequence (chosen and rejected), or of
        the first data.max_eval_rows training pairs when there is no held-out data."""
        examples = self.eval_examples or self.train_examples[:self.cfg.data.max_eval_rows or 256]
        self.engine.eval()
        chosen, rejected = self._held_out_scores(examples)
        mean, std = run_setup.mean_and_std(torch.cat([chosen, rejected]))
        return mean, max(std, 1e-6)

    def _micro_batch(self, rows: list[int]) -> loop.MicroBatch:
        loss, accuracy, margin, tokens = self._loss([self.train_examples[i] for i in rows])
        return loop.MicroBatch(loss, tokens, {"accuracy": accuracy, "margin": margin})

    def _pair_length(self, row: int) -> int:
        """A pair's padded length in a micro-batch (train.group_by_length): its longer side, or with
        rm.share_prompt its one row."""
        pair = self.train_examples[row]
        chosen, rejected = len(pair["chosen_input_ids"]), len(pair["rejected_input_ids"])
        if self.cfg.rm.share_prompt:
            return chosen + rejected - pair["prompt_len"]
        return max(chosen, rejected)

    def train(self) -> dict[str, float]:
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                           micro_batch_loss=self._micro_batch, window=loop.MeanWindow(),
                                           evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                           tokenizer=self.tokenizer,
                                           row_length=self._pair_length)
        with watchdog.phase("eval"):
            mean, std = self.normalization_constants()
        set_reward_normalization(self.engine.module, mean, std)
        last_eval.update(reward_mean=mean, reward_std=std)
        # Under ZeRO-3 the engine gathers the sharded weights for the leader (save_hf / the LoRA path), and the
        # config written with them carries the normalisation constants.
        loop.finish_training(self.run, self.engine, self.tokenizer)
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = RewardModelRecipe(cfg)
    recipe.setup()
    return recipe.train()
