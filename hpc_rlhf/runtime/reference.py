"""Reference log-probs for the direct preference modes (DPO, IPO, cDPO, KTO).

Both losses compare the policy with a frozen copy of the initial policy, the reference. `ref.mode` says where
the reference's numbers come from:

- `colocated`: the frozen model lives on the same ranks as the policy and scores every micro-batch as it comes.
  Under ZeRO-3 it is sharded like the policy by a DeepSpeed engine built without an optimizer: DeepSpeed then
  only partitions the parameters and gathers them for each forward pass, and the engine never steps. Under
  ZeRO 0-2 it is a plain frozen module on every rank: those stages shard optimizer states and gradients, and a
  frozen model has neither.
- `precompute`: before training the same frozen model scores every training and held-out sequence once (each
  rank a share, summed over the world), the table stays in memory and the model is freed. Training then runs one
  forward pass per micro-batch instead of two, and the reference's memory goes to the policy. The pass costs
  about one epoch of forward passes; a resumed run repeats it (it is deterministic, so the table is the same).

Rows and slots: a data set ("split") is a list of rows, each with the same number K of scored sequences (slots):
DPO has chosen and rejected, KTO the completion and a mismatched completion. Model batches are slot-major, as
`pair_collate` makes them: the B rows' slot 0 first, then their slot 1, ...

Each sequence gets two numbers: the sum of its response tokens' log-probs (log pi(y|x), what DPO and KTO use)
and their mean (the length-normalised log-prob IPO uses).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.algorithms.logprobs import sequence_logprob, token_logprobs
from hpc_rlhf.config import ConfigError, ModelSection, ReferenceSection, TrainSection
from hpc_rlhf.data.examples import IGNORE_INDEX, pad_collate
from hpc_rlhf.engines import deepspeed_compat
from hpc_rlhf.engines.train import resolve_dtype, zero3_window
from hpc_rlhf.models.builders import build_causal_lm

log = logging.getLogger("hpc_rlhf")

SUM, MEAN = 0, 1  # columns of a log-prob table


# --------------------------------------------------------------------------------------------- pure maths
def response_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits of a causal LM and (B, T) labels (-100 = no loss) -> (B, 2) float32: per row the sum
    and the mean of the log-probs of its label tokens. Position t's logits predict the label at t + 1."""
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    logps = token_logprobs(logits[:, :-1], targets.masked_fill(~scored, 0))
    return torch.stack([sequence_logprob(logps, scored), sequence_logprob(logps, scored, average=True)], dim=-1)


def model_response_logps(model, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(B, 2) sum and mean response log-probs of a collated batch (input_ids, attention_mask, labels)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return response_logps(logits, batch["labels"])


def balanced_chunks(num_items: int, rank: int, world: int, chunk_size: int) -> list[list[int]]:
    """This rank's items (every world-th one) cut into chunks, with every rank getting the same number of
    chunks; the ranks with fewer items get empty chunks at the end. A ZeRO-3 forward pass gathers parameters
    collectively, so every rank must run as many of them as the others (an empty chunk runs a dummy pass)."""
    if num_items < 0 or chunk_size < 1:
        raise ValueError(f"need num_items >= 0 and chunk_size >= 1, got {num_items} and {chunk_size}")
    mine = list(range(rank, num_items, world))
    num_chunks = math.ceil(math.ceil(num_items / world) / chunk_size)
    return [mine[i * chunk_size:(i + 1) * chunk_size] for i in range(num_chunks)]


# ------------------------------------------------------------------------------------------ frozen model
class FrozenModel:
    """The reference model, frozen, on every rank of `group` (sharded under ZeRO-3; see the module docstring)."""

    def __init__(self, model_cfg: ModelSection, train_cfg: TrainSection, device: torch.device, group=None,
                 build=build_causal_lm):
        """`build(model_cfg, for_training=False)` makes the model: a causal LM (reference) by default, or
        `hpc_rlhf.models.value_model.build_value_model` for a frozen reward model."""
        self.group = dist.GroupMember.WORLD if group is None else group
        model_cfg = dataclasses.replace(model_cfg, gradient_checkpointing=False)
        self.dtype = resolve_dtype(model_cfg.dtype)
        model = build(model_cfg, for_training=False)
        # A QLoRA run loads the reference in 4 bits too, already placed on its GPU; such a model cannot be cast.
        quantized = getattr(model, "is_loaded_in_4bit", False)
        self.engine = None
        if train_cfg.zero_stage == 3:
            if quantized:
                raise ConfigError("a 4-bit reference model (model.lora.load_in_4bit) cannot be sharded with "
                                  "train.zero_stage=3; use ZeRO 0-2 with QLoRA")
            model = model.to(self.dtype)
            deepspeed = deepspeed_compat.import_deepspeed()

            size = dist.get_world_size(self.group)
            config = {"train_micro_batch_size_per_gpu": train_cfg.micro_batch_size,
                      "train_batch_size": train_cfg.micro_batch_size * size,
                      "gradient_accumulation_steps": 1,
                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold":
                                            train_cfg.zero3_param_persistence_threshold,
                                            **zero3_window(sum(p.numel() for p in model.parameters()))},
                      "bf16": {"enabled": self.dtype == torch.bfloat16},
                      "fp16": {"enabled": self.dtype == torch.float16},
                      "steps_per_print": 2**62}
            with deepspeed_compat.keep_collectives_in_group(self.group):
                self.engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                                            mpu=deepspeed_compat.RoleMpu(self.group),
                                                            dist_init_required=False)
            self.engine.eval()
            # its forwards, through the engine or by a caller of `model`, keep DeepSpeed's collectives in the group
            deepspeed_compat.keep_module_in_group(self.engine.module, self.group)
            self.model = self.engine
        else:
            self.model = model if quantized else model.to(device=device, dtype=self.dtype)

    @torch.no_grad()
    def __call__(self, **batch):
        return self.model(**batch)

    @property
    def config(self):
        """The model's Hugging Face config (also behind a DeepSpeed engine)."""
        return getattr(self.model, "module", self.model).config

    def close(self) -> None:
        """Free the model (and the engine's partitions and hooks)."""
        if self.engine is not None:
            self.engine.destroy()
        self.engine = self.model = None
        gc.collect()


# ------------------------------------------------------------------------------------------ the reference
class Reference:
    """Reference log-probs of the sequences of named splits (see the module docstring for rows and slots).

        reference = Reference(cfg.ref, cfg.model, cfg.train, pad_id, device)
        reference.prepare({"train": [[chosen, rejected], ...], "eval": [...]})   # precompute: scores all here
        ref = reference.logps("train", row_ids, batch)   # (K * B, 2), batch = the slot-major model input

    Every rank of `group` makes the same calls (a ZeRO-3 reference gathers parameters collectively).
    """

    def __init__(self, ref_cfg: ReferenceSection, model_cfg: ModelSection, train_cfg: TrainSection, pad_id: int,
                 device: torch.device, group=None):
        self.mode = ref_cfg.mode
        self.pad_id = pad_id
        self.device = device
        self.group = group
        self.micro_batch_size = train_cfg.micro_batch_size
        ref_model_cfg = dataclasses.replace(model_cfg, path=ref_cfg.path or model_cfg.path)
        self.model: FrozenModel | None = FrozenModel(ref_model_cfg, train_cfg, device, group)
        self.tables: dict[str, torch.Tensor] = {}

    def prepare(self, splits: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> None:
        """In precompute mode, score every sequence of every split, then free the model; else nothing."""
        if self.mode != "precompute":
            return
        for name, rows in splits.items():
            self.tables[name] = self._score_all(rows)
            log.info("reference: scored %d sequences of %s", self.tables[name].shape[0] * self.tables[name].shape[1],
                     name)
        self.model.close()
        self.model = None

    def _score_all(self, rows: Sequence[Sequence[Mapping[str, Any]]]) -> torch.Tensor:
        """(N, K, 2) table: each rank scores its share of the N * K sequences; the shares are summed."""
        if not rows:
            return torch.zeros(0, 0, 2)
        slots = len(rows[0])
        flat = [seq for row in rows for seq in row]
        if len(flat) != len(rows) * slots:
            raise ValueError("every row needs the same number of sequences")
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        table = torch.zeros(len(flat), 2, dtype=torch.float64)
        for chunk in balanced_chunks(len(flat), rank, world, self.micro_batch_size * slots):
            batch = self._collate([flat[i] for i in (chunk or [0])])
            logps = model_response_logps(self.model, batch).double().cpu()
            if chunk:
                table[chunk] = logps
        table = table.to(self.device)
        dist.all_reduce(table, group=self.group)
        return table.to(torch.float32).cpu().view(len(rows), slots, 2)

    def _collate(self, sequences: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch = pad_collate([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in sequences], self.pad_id)
        return {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask", "labels")}

    @torch.no_grad()
    def logps(self, split: str, row_ids: Sequence[int], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(K * B, 2) sum and mean log-probs of `batch` (slot-major, B = len(row_ids)) under the reference."""
        if self.mode == "colocated":
            return model_response_logps(self.model, batch)
        if split not in self.tables:
            raise KeyError(f"reference log-probs of '{split}' were not precomputed (prepare() was given "
                           f"{sorted(self.tables)})")
        rows = self.tables[split][torch.as_tensor(list(row_ids), dtype=torch.long)]  # (B, K, 2)
        return rows.transpose(0, 1).reshape(-1, 2).to(batch["input_ids"].device)
