"""`hpc-rlhf kd`: knowledge distillation, supervised fine-tuning toward a frozen teacher.

The data is SFT's (prompt/response pairs or chats, the same keys and truncation). At every response token the
student learns both the data's next token and the teacher's whole next-token distribution:

    loss = (1 - kd.coef) x next-token loss of the data  +  kd.coef x cross-entropy against the teacher

(algorithms.losses.distillation_loss), each a mean over the response tokens of the optimizer step, whatever
micro-batch or rank holds them. The teacher (`kd.teacher`, a causal LM with the student's tokenizer) is frozen on
every rank beside the student, sharded like it under ZeRO-3 (runtime.reference.FrozenModel). With a teacher
that is right where the data is wrong, the student follows the teacher there as soon as its weight outweighs the
data's mistakes. Logged: loss, nll and kd_loss; held out, eval_nll and eval_kd_loss on `data.eval_files` and
exact match by greedy generation on `eval.prompt_files`.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.losses import distillation_loss
from hpc_rlhf.config import ConfigError, ModelSection
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import (build_causal_lm, load_tokenizer, same_output_width_problem,
                                      same_tokenizer_problem)
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.evaluation import generation_exact_match, load_eval_prompts
from hpc_rlhf.runtime.reference import FrozenModel, balanced_chunks
from hpc_rlhf.trainers.config import KDConfig as Config  # the mode's keys, torch-free for --help and --dry-run
from hpc_rlhf.trainers.sft import label_tokens, load_train_and_eval, model_inputs, shifted_loss


class DistillationRecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "kd")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.data.eval_files,
                                          cfg.eval.prompt_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        run_setup.check_fits_model(cfg.data.max_len, cfg.model.path, "data.max_len")
        run_setup.check_fits_model(cfg.data.max_len, cfg.kd.teacher, "data.max_len")
        tokenizer_folder = cfg.model.tokenizer or cfg.model.path
        problem = same_tokenizer_problem(tokenizer_folder, cfg.kd.teacher, "model.tokenizer" if cfg.model.tokenizer
                                         else "model.path", "kd.teacher")
        problem = problem or same_output_width_problem(cfg.model.path, cfg.kd.teacher)
        if problem:
            raise ConfigError(problem)
        self.tokenizer = load_tokenizer(tokenizer_folder)
        self.train_examples, self.eval_examples = load_train_and_eval(cfg, self.tokenizer)
        self.eval_prompts = load_eval_prompts(cfg)
        self.engine = TrainEngine(build_causal_lm(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        teacher_cfg = ModelSection(path=cfg.kd.teacher, dtype=cfg.model.dtype,
                                   attn_implementation=cfg.model.attn_implementation)
        self.teacher = FrozenModel(teacher_cfg, cfg.train, run.device)
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _losses(self, batch_examples, packed: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(next-token loss, distillation loss) of a micro-batch, each a mean over its label tokens; the number
        of label tokens; the number of real tokens. `packed`: the examples are packed rows (data.packing)."""
        kwargs, labels = model_inputs(batch_examples, self.tokenizer.pad_token_id, packed,
                                      self.cfg.model.attn_implementation, self.run.device)
        logits = self.engine(**kwargs).logits.float()
        teacher_logits = self.teacher(**kwargs).logits  # cast at the label positions only (distillation_loss)
        if teacher_logits.shape[-1] != logits.shape[-1]:
            raise ConfigError(f"kd.teacher '{self.cfg.kd.teacher}' has {teacher_logits.shape[-1]} output tokens and "
                              f"model.path '{self.cfg.model.path}' {logits.shape[-1]}: the two must share the "
                              f"vocabulary and its size")
        nll = shifted_loss(logits, labels)
        kd = distillation_loss(logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:])
        real_tokens = sum(len(example["input_ids"]) for example in batch_examples)
        return nll, kd, int((labels[:, 1:] != -100).sum()), real_tokens

    def _combined(self, nll: torch.Tensor, kd: torch.Tensor) -> torch.Tensor:
        coef = self.cfg.kd.coef
        return (1.0 - coef) * nll + coef * kd

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        out = {}
        self.engine.eval()
        if self.eval_examples:
            totals = torch.zeros(3, dtype=torch.float64)  # nll x tokens, kd x tokens, tokens
            # Every rank makes the same number of forward passes (ZeRO-3 gathers parameters collectively in each).
            for chunk in balanced_chunks(len(self.eval_examples), self.run.rank, self.run.world_size,
                                         self.cfg.train.micro_batch_size):
                nll, kd, tokens, _ = self._losses([self.eval_examples[i] for i in chunk or [0]], packed=False)
                if chunk:
                    totals += torch.tensor([nll.item() * tokens, kd.item() * tokens, tokens], dtype=torch.float64)
            nll_sum, kd_sum, tokens = run_setup.reduce_sum(totals.tolist())
            tokens = max(tokens, 1)
            out.update(eval_nll=nll_sum / tokens, eval_kd_loss=kd_sum / tokens,
                       eval_loss=float(self._combined(torch.tensor(nll_sum / tokens), torch.tensor(kd_sum / tokens))))
        if self.eval_prompts:
            out["eval_accuracy"] = generation_exact_match(self.engine, self.tokenizer, self.eval_prompts, self.cfg)
        self.engine.train()
        return out

    def _micro_batch(self, rows: list[int]) -> loop.MicroBatch:
        nll, kd, loss_tokens, tokens = self._losses([self.train_examples[i] for i in rows],
                                                    packed=self.cfg.data.packing)
        return loop.MicroBatch(self._combined(nll, kd), tokens, {"nll": nll.detach(), "kd_loss": kd.detach()},
                               loss_tokens=loss_tokens)

    def train(self) -> dict[str, float]:
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                           micro_batch_loss=self._micro_batch, window=loop.MeanWindow(),
                                           evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                           tokenizer=self.tokenizer,
                                           loss_tokens_of=lambda rows: label_tokens(self.train_examples, rows),
                                           row_length=lambda row: len(self.train_examples[row]["input_ids"]))
        loop.finish_training(self.run, self.engine, self.tokenizer)
        self.teacher.close()
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = DistillationRecipe(cfg)
    recipe.setup()
    return recipe.train()
