"""`hpc-rlhf kto`: Kahneman-Tversky optimisation on single responses labelled desirable or undesirable.

No pairs are needed: each row is a prompt, a completion and a true/false label. With r = log pi(y|x) -
log ref(y|x) and the reference point z0, the loss pushes r above z0 for desirable completions and below it
for undesirable ones (algorithms.losses.kto_loss), weighted by `kto.desirable_weight` / `kto.undesirable_weight`.

z0 estimates KL(pi || ref) on mismatched pairs: every row is also scored with the completion of another row
(prompt i, completion of its partner). The partner of each row is fixed once for the data set by a seeded
cycle through all rows, not drawn per batch, so that `ref.mode=precompute` can score the mismatched pairs
once before training, as it does the matched ones (TRL pairs rows once at data preparation too). Per
micro-batch, z0 is the mean of r over the mismatched pairs of the batch, averaged over the data-parallel group,
detached and clamped at 0.

Logged: loss, kl (z0), the mean implied rewards beta * r of desirable and undesirable rows; on
`data.eval_files` the held-out reward gap (mean desirable minus mean undesirable implied reward) and, with
`eval.prompt_files`, the exact-match accuracy of greedy answers (eval_exact_match).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hpc_rlhf.algorithms.losses import kto_loss
from hpc_rlhf.config import DataSection
from hpc_rlhf.data.examples import kto_examples, pad_collate
from hpc_rlhf.data.loading import DataError, end_later_checks, load_rows
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.evaluation import generation_exact_match, load_eval_prompts
from hpc_rlhf.runtime.reference import SUM, Reference, balanced_chunks, response_logps
from hpc_rlhf.trainers.config import KTOConfig as Config  # the mode's keys, torch-free for --help and --dry-run


def load_kto_examples(paths, data: DataSection, tokenizer, where: str, max_rows) -> list[dict]:
    """Rows with prompt/completion/label -> tokenised examples with a bool "label", each bad row named (or skipped
    and counted, a label other than true/false/1/0 too, with data.on_bad_row=skip)."""
    required = {data.prompt_key: str, data.response_key: str, data.label_key: (bool, int)}
    rows, report = load_rows(paths, required=required, where=where, on_bad_row=data.on_bad_row, max_rows=max_rows)
    skipped_before = report.skipped
    columns = rows.to_dict()  # lists: iterating a dataset's rows or columns converts one value at a time
    examples = kto_examples(tokenizer, columns[data.prompt_key], columns[data.response_key], columns[data.label_key],
                            max_len=data.max_len, max_prompt_len=data.max_prompt_len,
                            chat_template=data.apply_chat_template, wheres=columns["_source"],
                            skipped=report if data.on_bad_row == "skip" else None)
    end_later_checks(report, skipped_before, len(examples))
    return examples


def kl_partners(num_rows: int, seed: int) -> list[int]:
    """partner[i]: the row whose completion row i is paired with for the KL estimate. One seeded cycle through
    all rows, so no row is its own partner and every completion is used exactly once."""
    if num_rows < 2:
        raise ValueError(f"the KL reference point needs at least 2 rows to mismatch, got {num_rows}")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    partners = [0] * num_rows
    for position, row in enumerate(order):
        partners[row] = order[(position + 1) % num_rows]
    return partners


def mismatched_example(prompt_from: dict, completion_from: dict, max_len: int) -> dict:
    """The prompt tokens of one example followed by the completion tokens (and labels) of another, cut at
    max_len like any example."""
    cut = prompt_from["prompt_len"]
    start = completion_from["prompt_len"]
    ids = prompt_from["input_ids"][:cut] + completion_from["input_ids"][start:]
    labels = prompt_from["labels"][:cut] + completion_from["labels"][start:]
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "prompt_len": cut}


class KTOWindow:
    """KTO's figures over a logging window, from sums and counts rather than means: a micro-batch may hold no
    desirable (or no undesirable) row. Non-finite losses are left out of the mean loss, as in loop.MeanWindow."""

    def __init__(self) -> None:
        # loss sum, finite losses, kl sum, micro-batches, desirable reward sum, desirable rows, undesirable
        # reward sum, undesirable rows
        self.sums = torch.zeros(8, dtype=torch.float64)

    def add(self, figures: dict) -> None:
        loss = float(figures["loss"])
        finite = math.isfinite(loss)
        rewards, good = figures["rewards"].double().cpu(), figures["desirable"].cpu()
        self.sums += torch.tensor([loss if finite else 0.0, float(finite), float(figures["kl"]), 1.0,
                                   float(rewards[good].sum()), float(good.sum()), float(rewards[~good].sum()),
                                   float((~good).sum())], dtype=torch.float64)

    def summary(self) -> dict[str, float]:
        loss, finite_losses, kl, micro_batches, good_sum, good_count, bad_sum, bad_count = run_setup.reduce_sum(
            self.sums.tolist())
        self.sums.zero_()
        return {"loss": loss / finite_losses if finite_losses else float("nan"), "kl": kl / micro_batches,
                "desirable_reward": good_sum / max(good_count, 1), "undesirable_reward": bad_sum / max(bad_count, 1)}


class KTORecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "kto")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.ref.path, cfg.data.train_files, cfg.data.eval_files,
                                          cfg.eval.prompt_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.train_examples = load_kto_examples(cfg.data.train_files, cfg.data, self.tokenizer, "data.train_files",
                                                cfg.data.max_train_rows)
        if len(self.train_examples) < 2:
            raise DataError(f"data.train_files: KTO needs at least 2 rows (one is scored with another's "
                            f"completion for the KL reference point), got {len(self.train_examples)}")
        partners = kl_partners(len(self.train_examples), cfg.train.seed)
        self.train_sequences = [
            [example, mismatched_example(example, self.train_examples[partner], cfg.data.max_len)]
            for example, partner in zip(self.train_examples, partners)]
        self.eval_examples = (load_kto_examples(cfg.data.eval_files, cfg.data, self.tokenizer, "data.eval_files",
                                                cfg.data.max_eval_rows) if cfg.data.eval_files else [])
        self.eval_prompts = load_eval_prompts(cfg)
        self.engine = TrainEngine(build_causal_lm(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        self.reference = Reference(cfg.ref, cfg.model, cfg.train, self.tokenizer.pad_token_id, run.device)
        self.reference.prepare({"train": self.train_sequences, "eval": [[ex] for ex in self.eval_examples]})
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _collate(self, sequences) -> dict[str, torch.Tensor]:
        batch = pad_collate([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in sequences],
                            self.tokenizer.pad_token_id)
        return {k: batch[k].to(self.run.device) for k in ("input_ids", "attention_mask", "labels")}

    def _policy_logps(self, batch, rows: slice) -> torch.Tensor:
        logits = self.engine(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                             use_cache=False).logits
        return response_logps(logits, batch["labels"][rows])[:, SUM]

    def _micro_batch(self, micro: list[int]) -> loop.MicroBatch:
        """Loss and figures of one micro-batch: B matched rows (with gradients) and their B mismatched pairs
        (for z0, without), collated together so that the reference sees one slot-major batch."""
        kto = self.cfg.kto
        b = len(micro)
        batch = self._collate([self.train_sequences[i][k] for k in (0, 1) for i in micro])
        policy = self._policy_logps(batch, slice(0, b))
        with torch.no_grad():
            policy_mismatched = self._policy_logps(batch, slice(b, 2 * b))
        reference = self.reference.logps("train", micro, batch)[:, SUM]
        # Every rank runs the same number of micro-batches, so this all-reduce pairs up across the group.
        kl = (policy_mismatched - reference[b:]).mean().detach().reshape(1)
        dist.all_reduce(kl)
        kl = (kl / dist.get_world_size()).clamp(min=0)
        desirable = torch.tensor([self.train_examples[i]["label"] for i in micro], device=policy.device)
        loss, rewards = kto_loss(policy, reference[:b], desirable, kl[0], beta=kto.beta,
                                 desirable_weight=kto.desirable_weight, undesirable_weight=kto.undesirable_weight)
        return loop.MicroBatch(loss, int(batch["attention_mask"][:b].sum()),
                                 {"kl": kl[0], "rewards": rewards, "desirable": desirable})

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        out: dict[str, float] = {}
        self.engine.eval()
        if self.eval_examples:
            totals = torch.zeros(4, dtype=torch.float64)  # desirable reward sum and count, undesirable sum, count
            for chunk in balanced_chunks(len(self.eval_examples), self.run.rank, self.run.world_size,
                                         self.cfg.train.micro_batch_size):
                rows = chunk or [0]
                batch = self._collate([self.eval_examples[i] for i in rows])
                policy = self._policy_logps(batch, slice(None))
                rewards = (self.cfg.kto.beta * (policy - self.reference.logps("eval", rows, batch)[:, SUM])).double()
                if chunk:
                    good = torch.tensor([self.eval_examples[i]["label"] for i in chunk], device=rewards.device)
                    totals += torch.tensor([float(rewards[good].sum()), float(good.sum()),
                                            float(rewards[~good].sum()), float((~good).sum())], dtype=torch.float64)
            good_sum, good_count, bad_sum, bad_count = run_setup.reduce_sum(totals.tolist())
            good_mean = good_sum / max(good_count, 1)
            bad_mean = bad_sum / max(bad_count, 1)
            out.update(eval_desirable_reward=good_mean, eval_undesirable_reward=bad_mean,
                       eval_reward_gap=good_mean - bad_mean)
        if self.eval_prompts:
            out["eval_exact_match"] = generation_exact_match(self.engine, self.tokenizer, self.eval_prompts, self.cfg)
        self.engine.train()
        return out

    def train(self) -> dict[str, float]:
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                           micro_batch_loss=self._micro_batch, window=KTOWindow(),
                                           evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                           tokenizer=self.tokenizer)
        loop.finish_training(self.run, self.engine, self.tokenizer)
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = KTORecipe(cfg)
    recipe.setup()
    return recipe.train()
