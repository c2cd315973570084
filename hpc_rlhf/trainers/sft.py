"""`hpc-rlhf sft`: supervised fine-tuning on prompt/response pairs or multi-turn chats.

The loss is taken on response tokens only (every assistant turn of a chat). The whole world is one
data-parallel group. Held-out figures: token loss on `data.eval_files` and, when `eval.prompt_files` is set,
exact-match accuracy of greedy answers against the reference answers.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algorithms.losses import sft_loss
from hpc_rlhf.data.examples import pad_collate, sft_example, sft_examples
from hpc_rlhf.data.loading import Messages, load_rows
from hpc_rlhf.data.packing import pack_examples, packed_collate, packed_model_kwargs
from hpc_rlhf.dist.exchange import comm_device
from hpc_rlhf.engines.train import TrainEngine
from hpc_rlhf.models.builders import build_causal_lm, load_tokenizer
from hpc_rlhf.runtime import loop
from hpc_rlhf.runtime import run as run_setup
from hpc_rlhf.runtime.evaluation import generation_exact_match, load_eval_prompts
from hpc_rlhf.runtime.reference import balanced_chunks
from hpc_rlhf.trainers.config import SFTConfig as Config  # the mode's keys, torch-free for --help and --dry-run


def load_sft_examples(paths, cfg: Config, tokenizer, where: str, max_rows):
    """Rows with prompt/response (or messages) -> tokenised examples, each bad row named by file and line."""
    data = cfg.data
    chat = data.apply_chat_template
    probe, _ = load_rows(paths, required={}, where=where, on_bad_row=data.on_bad_row, max_rows=1)
    uses_messages = data.messages_key in probe.column_names and data.prompt_key not in probe.column_names
    required = {data.messages_key: Messages} if uses_messages else {data.prompt_key: str, data.response_key: str}
    rows, _ = load_rows(paths, required=required, where=where, on_bad_row=data.on_bad_row, max_rows=max_rows)
    columns = rows.to_dict()  # lists: iterating a dataset's rows or columns converts one value at a time
    if uses_messages:
        return [sft_example(tokenizer, messages=messages, max_len=data.max_len, max_prompt_len=data.max_prompt_len,
                            chat_template=chat, where=where)
                for messages, where in zip(columns[data.messages_key], columns["_source"])]
    return sft_examples(tokenizer, columns[data.prompt_key], columns[data.response_key], max_len=data.max_len,
                        max_prompt_len=data.max_prompt_len, chat_template=chat, wheres=columns["_source"])


def load_train_and_eval(cfg, tokenizer) -> tuple[list, list]:
    """(training examples, held-out examples) of `data.train_files` and `data.eval_files`; the training ones in
    packed rows with data.packing."""
    data = cfg.data
    train = load_sft_examples(data.train_files, cfg, tokenizer, "data.train_files", data.max_train_rows)
    held_out = (load_sft_examples(data.eval_files, cfg, tokenizer, "data.eval_files", data.max_eval_rows)
                if data.eval_files else [])
    return (pack_examples(train, data.max_len) if data.packing else train), held_out


def model_inputs(examples, pad_id: int, packed: bool, attn_implementation: str,
                 device) -> tuple[dict, torch.Tensor]:
    """(the model's keyword arguments, the labels) of a micro-batch of examples, on `device`. `packed`: the
    examples are packed rows (training with data.packing; held-out examples are never packed)."""
    if packed:
        batch = packed_collate(examples, pad_id)
        kwargs = packed_model_kwargs(batch, attn_implementation)
    else:
        batch = pad_collate(examples, pad_id)
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    return kwargs, batch["labels"].to(device)


def label_tokens(examples, rows: list[int]) -> int:
    """The label tokens of these rows, which a next-token loss is a mean over (as shifted_loss counts them)."""
    return sum(int((torch.as_tensor(examples[i]["labels"])[1:] != -100).sum()) for i in rows)


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss: position t's logits predict the label at t+1."""
    return sft_loss(logits[:, :-1], labels[:, 1:])


class SFTRecipe:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.run = run = run_setup.start_run(cfg, "sft")
        run_setup.ensure_tiny_assets_if_used(cfg.model.path, cfg.data.train_files, cfg.data.eval_files,
                                          cfg.eval.prompt_files)
        run_setup.check_batch_sizes(cfg.train, run.world_size)
        run_setup.check_fits_model(cfg.data.max_len, cfg.model.path, "data.max_len")  # input validation up front
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.train_examples, self.eval_examples = load_train_and_eval(cfg, self.tokenizer)
        self.eval_prompts = load_eval_prompts(cfg)
        self.engine = TrainEngine(build_causal_lm(cfg.model), cfg.train, group=None, model_dtype=cfg.model.dtype)
        self.bad_steps, self.stop = loop.start_training(run, {"model": self.engine})

    def _forward_loss(self, batch_examples, packed: bool) -> tuple[torch.Tensor, int, int]:
        """Mean next-token loss of a micro-batch, its number of label tokens, its number of real tokens. `packed`:
        the examples are packed rows (training with data.packing; held-out examples are never packed)."""
        kwargs, labels = model_inputs(batch_examples, self.tokenizer.pad_token_id, packed,
                                      self.cfg.model.attn_implementation, self.run.device)
        logits = self.engine(**kwargs).logits
        real_tokens = sum(len(example["input_ids"]) for example in batch_examples)
        return shifted_loss(logits.float(), labels), int((labels[:, 1:] != -100).sum()), real_tokens

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        out = {}
        self.engine.eval()
        if self.eval_examples:
            total = torch.zeros(2, dtype=torch.float64)
            # Every rank makes the same number of forward passes (ZeRO-3 gathers parameters collectively in each):
            # a rank out of examples runs a dummy pass whose result it drops.
            for chunk in balanced_chunks(len(self.eval_examples), self.run.rank, self.run.world_size,
                                         self.cfg.train.micro_batch_size):
                loss, tokens, _ = self._forward_loss([self.eval_examples[i] for i in chunk or [0]], packed=False)
                if chunk:
                    total += torch.tensor([loss.item() * tokens, tokens], dtype=torch.float64)
            total = total.to(comm_device())  # NCCL reduces CUDA tensors only; gloo keeps it on the CPU
            torch.distributed.all_reduce(total)
            total = total.cpu()
            out["eval_loss"] = float(total[0] / max(total[1], 1))
        if self.eval_prompts:
            out["eval_accuracy"] = generation_exact_match(self.engine, self.tokenizer, self.eval_prompts, self.cfg)
        self.engine.train()
        return out

    def _micro_batch(self, rows: list[int]) -> loop.MicroBatch:
        loss, loss_tokens, tokens = self._forward_loss([self.train_examples[i] for i in rows],
                                                        packed=self.cfg.data.packing)
        return loop.MicroBatch(loss, tokens, loss_tokens=loss_tokens)

    def train(self) -> dict[str, float]:
        # The loss is a mean over every response token of the optimizer step (loop.train_one_model).
        last_eval = loop.train_one_model(self.run, self.engine, num_rows=len(self.train_examples),
                                           micro_batch_loss=self._micro_batch, window=loop.MeanWindow(),
                                           evaluate=self.evaluate, bad_steps=self.bad_steps, stop=self.stop,
                                           tokenizer=self.tokenizer,
                                           loss_tokens_of=lambda rows: label_tokens(self.train_examples, rows),
                                           row_length=lambda row: len(self.train_examples[row]["input_ids"]))
        loop.finish_training(self.run, self.engine, self.tokenizer)
        return last_eval


def run(cfg: Config) -> dict[str, float]:
    recipe = SFTRecipe(cfg)
    recipe.setup()
    return recipe.train()
