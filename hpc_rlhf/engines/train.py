"""The training engine: one model trained with DeepSpeed ZeRO (stage 0-3) on a role's process group.

    engine = TrainEngine(model, cfg.train, group=groups.role_group("actor"))
    for micro_batch in micro_batches:            # gradient_accumulation_steps of them per optimizer step
        loss = loss_fn(engine(**micro_batch), micro_batch)
        engine.backward(loss)
        info = engine.step()                     # info.stepped on the accumulation boundary

Every rank of the role makes the same calls in the same order; ranks of other roles are not involved, not
even in construction, checkpointing or saving (see deepspeed_compat for how DeepSpeed is kept in the group).
`backward` takes the mean loss of one micro-batch: DeepSpeed divides it by the accumulation steps and averages
gradients over the role, so an optimizer step follows the mean over `train.batch_size` sequences.

Memory under ZeRO-3: no method here makes the whole model present on a rank. Forward passes (through the engine
or the bare `module`, e.g. for scoring or generation) fetch one module's parameters at a time through
DeepSpeed's hooks; `full_state()` streams the full weights one module at a time. Besides the module being run,
DeepSpeed keeps a window of parameters gathered (prefetched, or kept because they are used again soon), a
bucket of full-size gradients before it reduce-scatters them, and steps the optimizer over sub-groups of the
rank's partition (AdamW's temporaries are as large as a sub-group): each at most `ZERO3_WINDOW_SHARE` of the
model, and never more than DeepSpeed's own defaults (1e9 parameters, a 5e8-element gradient bucket, 1e9-element
sub-groups). Those defaults are sized for models of tens of billions of parameters: left as they are, a model of
up to a billion parameters would stay gathered whole from forward to backward, every rank would hold all of its
gradients unreduced, and the optimizer step would make temporary copies of the rank's whole partition
(measured: benchmarks/memory_scaling.py). `gathered_parameters()` (every parameter at once) is for
code outside the RL step: evaluation by generation in the one-model modes and saving LoRA adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from hpc_rlhf.config import ConfigError, TrainSection
from hpc_rlhf.dist.exchange import comm_device
from hpc_rlhf.engines import deepspeed_compat, reshard
from hpc_rlhf.engines.schedule import warmup_cosine_scheduler
from hpc_rlhf.models.lora import adapter_tensors, merged_tensors
from hpc_rlhf.models.saving import save_pretrained_on_this_rank

# What DeepSpeed may hold besides the module running now, as a share of the model (see the module docstring):
# parameters gathered ahead or kept for reuse, the bucket gradients are reduced from, an optimizer sub-group.
ZERO3_WINDOW_SHARE = 1 / 8
DEEPSPEED_WINDOW_DEFAULTS = {"stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
                             "stage3_prefetch_bucket_size": 5 * 10**7, "reduce_bucket_size": 5 * 10**8,
                             "sub_group_size": 10**9}
CHECKPOINT_TAG = "engine"  # deepspeed's sub-folder inside a checkpoint folder; fixed so loading needs no `latest`
COMPLETE_MARKER = "ENGINE_COMPLETE.json"  # written by the role leader once every rank of the role has saved


@dataclasses.dataclass
class StepInfo:
    """What `TrainEngine.step()` did.

    stepped: this call ended a gradient-accumulation cycle (an optimizer step was due).
    grad_norm: global gradient norm before clipping, on stepped calls (None otherwise).
    lr: learning rate the due update used (or would have used, when skipped).
    finite: False when the gradients were not finite; DeepSpeed then skipped the update (weights, optimizer and
        learning-rate schedule unchanged) and the caller decides whether to go on (train.max_bad_steps).
    """
    stepped: bool
    grad_norm: float | None
    lr: float
    finite: bool = True

    @property
    def skipped(self) -> bool:
        return self.stepped and not self.finite


def resolve_dtype(model_dtype: torch.dtype | str | None) -> torch.dtype:
    """None/"auto" -> bfloat16 on GPU, float32 on CPU; names as in `model.dtype` of the config."""
    if model_dtype is None or model_dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(model_dtype, torch.dtype):
        return model_dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if model_dtype not in names:
        raise ConfigError(f"model.dtype must be one of {['auto', *names]}, got {model_dtype!r}")
    return names[model_dtype]


def gradient_accumulation_steps(train_cfg: TrainSection, role_size: int, sequence_parallel: int = 1) -> int:
    """Micro-batches per optimizer step on each rank: the batch over the role's data-parallel ranks (its ranks /
    the sequence blocks' size: a block's ranks share each micro-batch)."""
    replicas = role_size // sequence_parallel
    per_pass = train_cfg.micro_batch_size * replicas
    if train_cfg.batch_size % per_pass != 0:
        blocks = f" / {sequence_parallel} ranks per sequence block" if sequence_parallel > 1 else ""
        raise ConfigError(f"train.batch_size={train_cfg.batch_size} must be a multiple of train.micro_batch_size "
                          f"x data-parallel ranks of the role = {train_cfg.micro_batch_size} x {replicas} = "
                          f"{per_pass} ({role_size} ranks{blocks})")
    return train_cfg.batch_size // per_pass


def zero3_window(num_params: int) -> dict[str, int]:
    """DeepSpeed's ZeRO-3 gathering window and gradient bucket for a model of `num_params` parameters (see the
    module docstring)."""
    share = max(1, int(num_params * ZERO3_WINDOW_SHARE))
    return {key: min(default, share) for key, default in DEEPSPEED_WINDOW_DEFAULTS.items()}


def deepspeed_config(train_cfg: TrainSection, role_size: int, dtype: torch.dtype,
                     num_params: int | None = None, sequence_parallel: int = 1) -> dict[str, Any]:
    """The DeepSpeed config dict for `train_cfg` on a role of `role_size` ranks (`num_params`: the model's
    parameter count, which sizes ZeRO-3's gathering window; None leaves DeepSpeed's defaults;
    `sequence_parallel`: ranks per sequence block). DeepSpeed averages gradients over all the role's ranks; the
    ranks of a block hold parts of one micro-batch's gradient, and its train_batch_size counts each micro-batch
    once per rank, that is K times per block."""
    if train_cfg.adam_offload and train_cfg.zero_stage == 0:
        raise ConfigError("train.adam_offload=true needs train.zero_stage 1, 2 or 3 (ZeRO-0 has no offload)")
    accumulation = gradient_accumulation_steps(train_cfg, role_size, sequence_parallel)
    zero: dict[str, Any] = {"stage": train_cfg.zero_stage}
    if train_cfg.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = train_cfg.zero3_param_persistence_threshold
        if num_params is not None:
            zero.update(zero3_window(num_params))
    if train_cfg.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    clips_itself = _clips_itself(train_cfg, dtype)
    return {
        "train_batch_size": train_cfg.micro_batch_size * accumulation * role_size,
        "train_micro_batch_size_per_gpu": train_cfg.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # ZeRO-0 in fp32 hands our optimizer to torch unchanged: we clip there ourselves (see _check_and_clip).
        "gradient_clipping": 0.0 if clips_itself else train_cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "checkpoint": dict(deepspeed_compat.CHECKPOINT_CONFIG),
        "steps_per_print": 2**62,  # progress is ours to log
        "wall_clock_breakdown": False,
    }


def _clips_itself(train_cfg: TrainSection, dtype: torch.dtype) -> bool:
    # With ZeRO-0 in fp32 DeepSpeed neither reports the gradient norm nor skips non-finite steps.
    return train_cfg.zero_stage == 0 and dtype == torch.float32


def _optimizer(model: torch.nn.Module, train_cfg: TrainSection):
    # Decay matrices only: decaying biases and norm gains pulls them towards 0, which they do not need.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    betas = (train_cfg.adam_beta1, train_cfg.adam_beta2)
    if train_cfg.adam_offload:
        # deepspeed refuses a torch optimizer with optimizer offload unless told not to, because torch's Adam
        # on the CPU is much slower than its cpu_adam op (a C++ op, JIT-compiled on first use unless deepspeed
        # was installed with DS_BUILD_CPU_ADAM=1).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=train_cfg.lr, betas=betas, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=betas)


class TrainEngine:
    """A model, its AdamW optimizer and warmup-cosine schedule under DeepSpeed ZeRO, on one role's group.

    group: the role's process group; None = the whole world. torch.distributed must be initialised already
        (hpc_rlhf.dist.bootstrap); DeepSpeed reuses that world.
    model_dtype: None/"auto" = bfloat16 on GPU, float32 on CPU.
    sequence_parallel: ranks of the group per sequence block (they share each micro-batch's rows).
    Gradient checkpointing is the model's: turn it on before building the engine. The engine starts in train
    mode.
    """

    def __init__(self, model: torch.nn.Module, train_cfg: TrainSection, group=None,
                 model_dtype: torch.dtype | str | None = None, sequence_parallel: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("TrainEngine needs torch.distributed initialised first (hpc_rlhf.dist.bootstrap)")
        deepspeed = deepspeed_compat.import_deepspeed()

        self.train_cfg = train_cfg
        self.group = dist.GroupMember.WORLD if group is None else group
        self.dtype = resolve_dtype(model_dtype)
        self.role_size = dist.get_world_size(self.group)
        self.role_rank = dist.get_rank(self.group)
        if self.role_rank < 0:
            raise ValueError(f"TrainEngine: rank {dist.get_rank()} is not a member of the group it was given")
        self.sequence_parallel = sequence_parallel
        self.config = deepspeed_config(train_cfg, self.role_size, self.dtype,
                                       num_params=sum(p.numel() for p in model.parameters()),
                                       sequence_parallel=sequence_parallel)
        self._clips_itself = _clips_itself(train_cfg, self.dtype)

        model = model.to(self.dtype)
        self._optimizer = _optimizer(model, train_cfg)
        scheduler = warmup_cosine_scheduler(self._optimizer, train_cfg.warmup_steps, train_cfg.max_steps,
                                            train_cfg.min_lr_ratio)
        with self._in_group():
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self._optimizer,
                                                        lr_scheduler=scheduler, config=self.config,
                                                        mpu=deepspeed_compat.RoleMpu(self.group),
                                                        dist_init_required=False)
        self.engine.train()  # from_pretrained leaves models in eval mode, where checkpointing is off
        if self.zero_stage == 3:  # forward passes of the bare module stay in the group too
            deepspeed_compat.keep_module_in_group(self.engine.module, self.group)

    # ---------------------------------------------------------------------------------------------- basics
    def _in_group(self):
        return deepspeed_compat.keep_collectives_in_group(self.group)

    @property
    def module(self) -> torch.nn.Module:
        """The model without the DeepSpeed wrapper (under ZeRO-3 its parameters are partitioned)."""
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def is_leader(self) -> bool:
        return self.role_rank == 0

    @property
    def zero_stage(self) -> int:
        return self.train_cfg.zero_stage

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config["gradient_accumulation_steps"]

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self._optimizer.param_groups[0]["lr"])

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far, skipped non-finite ones included."""
        return int(self.engine.global_steps)

    @property
    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    def train(self) -> "TrainEngine":
        self.engine.train()
        return self

    def eval(self) -> "TrainEngine":
        self.engine.eval()
        return self

    # -------------------------------------------------------------------------------------------- training
    def forward(self, *args, **batch):
        with self._in_group():
            return self.engine(*args, **batch)

    __call__ = forward

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """`boundary`: whether this micro-batch ends the gradient accumulation, when the caller's micro-batches
        per optimizer step vary (RL's micro-batches by tokens); None: DeepSpeed counts to its configured
        accumulation steps. DeepSpeed still divides the loss by those steps: the caller scales for them."""
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        with self._in_group():
            self.engine.backward(loss)

    def step(self) -> StepInfo:
        """End of one micro-batch; on the accumulation boundary, clip and update (or skip if not finite)."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        lr = self.lr
        skipped_before = self.engine.skipped_steps
        with self._in_group():
            if boundary and self._clips_itself:
                self._check_and_clip()
            self.engine.step()
        if not boundary:
            return StepInfo(stepped=False, grad_norm=None, lr=lr)
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        finite = self.engine.skipped_steps == skipped_before and (norm is None or math.isfinite(norm))
        return StepInfo(stepped=True, grad_norm=norm, lr=lr, finite=finite)

    def _check_and_clip(self) -> None:
        """ZeRO-0 fp32: clip, report the norm and skip non-finite steps the way DeepSpeed's ZeRO optimizers do.

        DeepSpeed's engine reads `optimizer.overflow` (skip the update and the schedule, count a skipped step)
        and `optimizer._global_grad_norm` from whatever optimizer it holds; gradients are already averaged over
        the role here (DeepSpeed all-reduces them in the boundary backward).
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.train_cfg.max_grad_norm
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = float(norm)
        overflow = not math.isfinite(norm)
        if overflow:
            for p in params:  # torch's AdamW leaves parameters without gradients untouched
                p.grad = None
        self._optimizer.overflow = overflow
        self._optimizer._global_grad_norm = math.inf if overflow else norm

    # ----------------------------------------------------------------------------------------- parameters
    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[torch.nn.Module]:
        """Full parameters inside the block on every rank of the role (ZeRO-3: ALL gathered at once, read-only;
        other stages: a no-op). Yields the unwrapped module. Every rank of the role must enter it.

        Not for the RL step, which never holds a whole model on a rank: see `full_state()` and the module
        docstring."""
        if self.zero_stage != 3:
            yield self.module
            return
        import deepspeed

        with self._in_group():
            # A forward pass inside the block (greedy generation for an evaluation) still runs ZeRO-3's module
            # hooks, which release parameters past the reuse window and prefetch the next ones; DeepSpeed refuses
            # to re-partition a parameter still in flight when the gather ends. Settling the hooks' work on both
            # sides of the block (DeepSpeed's public call: waits for what is in flight, releases all) avoids it.
            self.engine.empty_partition_cache()
            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                try:
                    yield self.module
                finally:
                    self.engine.empty_partition_cache()

    @contextlib.contextmanager
    def _gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """`params` whole on every rank of the role inside the block (ZeRO-3), else a no-op."""
        if self.zero_stage != 3 or not params:
            yield
            return
        import deepspeed

        with self._in_group(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield

    def full_state(self, on_every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights as (name, tensor) pairs, one module at a time, on the role leader (on every rank of
        the role with `on_every_rank`; the others yield nothing). Every rank of the role must exhaust it.

        Names are those of the plain transformers model; LoRA adapters are folded into their base weights
        (`models.lora.merged_tensors`). Under ZeRO-3 each module's parameters are gathered while its tensors are
        being yielded and released when the iterator moves on, so a yielded tensor is valid only until the next
        one is requested: copy what you keep. Tied parameters are yielded under each of their names.
        """
        emit = on_every_rank or self.is_leader
        if self.zero_stage == 3:
            # Forward passes without a backward (scoring, generation) can leave prefetched parameters gathered
            # or still in flight; release them first (DeepSpeed's public call for it).
            with self._in_group():
                self.engine.empty_partition_cache()
        for name, tensor in merged_tensors(self.module, gather=self._gathered, emit=emit):
            yield name, tensor

    def adapter_state(self, on_every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter alone as (name, tensor) pairs (names of PEFT's adapter file), one LoRA layer at a time,
        on the role leader (on every rank of the role with `on_every_rank`); the frozen base is not read. Every
        rank of the role must exhaust it; under ZeRO-3 a yielded tensor is valid only until the next one is
        requested (as `full_state`)."""
        emit = on_every_rank or self.is_leader
        if self.zero_stage == 3:
            with self._in_group():
                self.engine.empty_partition_cache()
        yield from adapter_tensors(self.module, gather=self._gathered, emit=emit)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full state on CPU at the role leader ({} on the other ranks of the role), from `full_state()`.

        This is a whole copy of the model in host memory, for saving (`save_hf`); the RL step streams
        `full_state()` instead. Tied parameters stay one tensor under both names. Every rank of the role must
        call it.
        """
        copies: dict[int, torch.Tensor] = {}
        return {name: _cpu_copy(tensor, copies) for name, tensor in self.full_state()}

    # -------------------------------------------------------------------------------------------- saving
    def save_checkpoint(self, directory: str | os.PathLike, client_state: dict | None = None) -> None:
        """DeepSpeed state (weights, optimizer, schedule, step counters) into `directory`, then the role leader
        writes COMPLETE_MARKER. Every rank of the role must call it; `directory` is this engine's own folder
        (one per engine and checkpoint)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)  # deepspeed creates it on global rank 0 only
        if self.is_leader:  # saving again into the same folder: it is incomplete until the new marker exists
            (directory / COMPLETE_MARKER).unlink(missing_ok=True)
        dist.barrier(group=self.group)
        with self._in_group():
            self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state=client_state or {},
                                        save_latest=False)
            dist.barrier(group=self.group)
        fingerprint = self.frozen_fingerprint()
        if self.is_leader:
            # role_size, zero_stage and dtype tell load_checkpoint whether and how to reshard (engines.reshard),
            # the frozen parameters' fingerprint whether a resharded engine has the same ones
            marker = {"tag": CHECKPOINT_TAG, "global_step": self.global_step, "role_size": self.role_size,
                      "zero_stage": self.zero_stage, "dtype": str(self.dtype).removeprefix("torch.")}
            if fingerprint is not None:
                marker["frozen_fingerprint"] = fingerprint
            tmp = directory / (COMPLETE_MARKER + ".tmp")
            tmp.write_text(json.dumps(marker))
            tmp.replace(directory / COMPLETE_MARKER)
        dist.barrier(group=self.group)

    def load_checkpoint(self, directory: str | os.PathLike, reshard_workers: int = 1) -> dict:
        """Restore what `save_checkpoint` wrote; returns the client state. Every rank of the role calls it.

        A checkpoint written by a role of another size (its marker's role_size) is resharded onto this one, with
        the optimizer state (fp32 master weights, Adam's moments) and the schedule and step counters kept: under
        ZeRO 1-3 through DeepSpeed's universal checkpoint, converted once by the role leader into
        `<directory>/engine_universal_from_<N>` (engines.reshard); ZeRO-0 (nothing partitioned) loads as it is.
        What cannot be resharded (another ZeRO stage or dtype, frozen parameters other than those the checkpoint
        recorded) raises ValueError naming both sizes and why. On the same number of ranks nothing of this runs:
        the load is DeepSpeed's own, bit for bit.
        `reshard_workers`: the converter's worker processes (each holds one rank's optimizer shard in memory).
        """
        directory = Path(directory)
        marker_path = directory / COMPLETE_MARKER
        if not marker_path.is_file():
            raise FileNotFoundError(f"{directory} is not a complete engine checkpoint: {COMPLETE_MARKER} is missing")
        marker = json.loads(marker_path.read_text())
        frozen = [name for name, p in self.module.named_parameters() if not p.requires_grad]
        resharding = marker.get("role_size") != self.role_size and reshard.needs_conversion(self.zero_stage)
        # Every rank of the role reads the same marker: all of them or none enter the fingerprint's collective.
        fingerprint = self.frozen_fingerprint() if frozen and resharding else None
        refusal = reshard.reshard_refusal(marker, self.role_size, self.zero_stage, self.dtype, frozen, fingerprint)
        if refusal is not None:
            raise ValueError(f"{directory}: {refusal}")
        if resharding:
            return self._load_universal(directory, marker, reshard_workers)
        with self._in_group():
            path, client_state = self.engine.load_checkpoint(str(directory), tag=marker["tag"],
                                                             load_optimizer_states=True,
                                                             load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"deepspeed found no checkpoint under {directory / marker['tag']}")
        return client_state or {}

    def _load_universal(self, directory: Path, marker: dict, workers: int) -> dict:
        """The checkpoint in `directory` (saved on another number of ranks) through a universal copy of it: the
        role leader converts it (once: an existing copy is reused) while the others wait for the folder on the
        file system (engines.reshard says why not in a collective)."""
        saved = marker["role_size"]
        universal = reshard.universal_folder(directory, saved)
        # An attempt number from the leader names its failure note, so that no rank reads a note left by an
        # earlier failed attempt as this one's outcome.
        attempt = torch.tensor([int.from_bytes(os.urandom(6), "little") if self.is_leader else 0], dtype=torch.int64,
                               device=comm_device(self.group))  # NCCL refuses CPU tensors
        dist.broadcast(attempt, src=dist.get_global_rank(self.group, 0), group=self.group)
        try:
            if self.is_leader:
                reshard.convert_or_note_failure(directory / marker["tag"], universal, int(attempt.item()), workers)
            else:
                reshard.wait_for_conversion(universal, int(attempt.item()))
        except Exception as error:
            raise RuntimeError(f"{directory}: resharding from {saved} to {self.role_size} ranks failed: "
                               f"{error}") from error
        # Two slips of DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py,
        # load_hp_checkpoint_state_from_checkpoint_dir_stage3) are mended after it. It copies the FIRST parameter
        # group's settings onto every group, which would give our undecayed group (biases, norm gains) the
        # matrices' weight decay: what differs between groups is put back.
        per_group = self._per_group_settings()
        config = self.engine._config
        config.load_universal_checkpoint = True  # read by DeepSpeed's load_checkpoint only; off again below
        try:
            with self._in_group():
                path, client_state = self.engine.load_checkpoint(str(universal), tag=marker["tag"],
                                                                 load_optimizer_states=True,
                                                                 load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"deepspeed found no universal checkpoint under {universal / marker['tag']}")
        for group, settings in zip(self._optimizer.param_groups, per_group):
            group.update(settings)
        # The same load gives every ZeRO-3 sub-group ONE shared `step` tensor, which torch's AdamW increments in
        # place once per sub-group and step: the bias correction would run ahead (7 sub-groups: step 3 -> 10).
        for state in self._optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return client_state or {}

    def frozen_fingerprint(self) -> list[float] | None:
        """`reshard.frozen_fingerprint` of this engine's frozen parameters (None when it has none), the same on
        every rank of the role. Under ZeRO-3 every rank adds up the shards it holds (a collective in the role):
        nothing is gathered."""
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        if not frozen:
            return None
        if self.zero_stage != 3:
            return reshard.frozen_fingerprint(frozen)
        shards = []
        for param in frozen:
            shard = param.ds_tensor.reshape(-1)
            # The last ranks' shards are padded up to an equal size with whatever memory held: only the
            # parameter's own elements count.
            mine = max(0, min(shard.numel(), param.ds_numel - shard.numel() * self.role_rank))
            shards.append(shard.narrow(0, 0, mine))
        total = torch.tensor(reshard.frozen_fingerprint(shards), dtype=torch.float64, device=comm_device(self.group))
        dist.all_reduce(total, group=self.group)
        return total.tolist()

    def _per_group_settings(self) -> list[dict[str, Any]]:
        """The settings in which our parameter groups differ (weight decay: matrices only; see _optimizer)."""
        groups = self._optimizer.param_groups
        keys = [key for key in groups[0] if key != "params" and any(g.get(key) != groups[0][key] for g in groups)]
        return [{key: group[key] for key in keys} for group in groups]

    def save_hf(self, directory: str | os.PathLike, tokenizer=None) -> None:
        """The role leader writes a Hugging Face folder (safetensors, config, tokenizer) that
        `from_pretrained` loads unchanged. Models that are not plain transformers models are saved with their
        own `save_pretrained(directory, state_dict=...)`. Every rank of the role must call it."""
        state = self.full_state_dict()
        if self.is_leader:
            module = self.module
            save = getattr(module, "save_pretrained", None)
            if save is None:
                raise TypeError(f"save_hf: {type(module).__name__} has no save_pretrained(directory, state_dict=)")
            Path(directory).mkdir(parents=True, exist_ok=True)
            save_pretrained_on_this_rank(module, directory, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(directory))
        dist.barrier(group=self.group)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _cpu_copy(tensor: torch.Tensor, copies: dict[int, torch.Tensor]) -> torch.Tensor:
    # Parameters are keyed by their object (alive throughout) so tied weights share one copy, as save_pretrained
    # expects of them; other tensors (LoRA-merged weights) are new objects whose ids may be reused.
    if not isinstance(tensor, torch.nn.Parameter):
        return tensor.detach().to("cpu", copy=True)
    key = id(tensor)
    if key not in copies:
        copies[key] = tensor.detach().to("cpu", copy=True)
    return copies[key]
