"""Builders for the roles of an RL job (torchtune style: small functions the recipe calls in `setup()`): the ranks
per node, the rollout engine of a rollout rank, and a sequence-parallel role's attention.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hpc_rlhf.dist import groups
from hpc_rlhf.dist.bootstrap import current_launch
from hpc_rlhf.dist.devices import engine_visible_devices
from hpc_rlhf.models.builders import build_causal_lm
from hpc_rlhf.models import sequence_parallel
from hpc_rlhf.models.lora import apply_lora
from hpc_rlhf.rl.config import Config, longest_response


def ranks_per_node(world_size: int) -> int:
    """Ranks per node as the launcher reports them (call after init: under MPI the layout is known only then)."""
    info = current_launch()
    return (info.ranks_per_node if info is not None else None) or world_size


def sharded_attention(model, role: str) -> int:
    """The role's ranks per sequence block (placement key `<kind>_sp`); where more than one, the model's attention
    is switched to the sequence-parallel wrapper (hpc_rlhf/models/sequence_parallel.py), which leaves forwards of
    whole sequences as they were."""
    k = groups.plan().sequence_parallel(role)
    if k > 1:
        sequence_parallel.enable(model)
    return k


def build_rollout_engine(cfg: Config, plan, tokenizer, device, actor=None):
    """This rank's rollout engine: hf (on the actor's own module in the hybrid placement, else a copy of the
    initial actor), or vllm driven by the engine's first rank (None on its other ranks). With a LoRA actor the
    engine's own copy is the actor's frozen base with an adapter that each sync replaces (rl/sync.py)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if cfg.rollout.backend == "vllm":
        return build_vllm_engine(cfg, plan, eos)
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine  # transformers' generate: only rollout ranks

    if plan.is_hybrid:
        # Generate with the actor's own module. Under ZeRO-3 it gathers one module at a time in every forward
        # pass, so the actor's ranks decode in step (hf.py); the whole model is never gathered.
        in_step = actor.group if actor.zero_stage == 3 and actor.role_size > 1 else None
        return HFRolloutEngine(actor.module, pad, eos, max_batch_prompts=cfg.rollout.max_batch_prompts,
                               sync_group=in_step, decode_loop=cfg.rollout.hf_decode_loop)
    # built for inference: the base alone (a QLoRA actor's in 4 bits, as the actor's), frozen
    model = build_causal_lm(cfg.actor, for_training=False, device=device, where="actor")
    if cfg.actor.lora.rank > 0:
        model = apply_lora(model, cfg.actor.lora, where="actor.lora").requires_grad_(False).eval()
    return HFRolloutEngine(model, pad, eos, max_batch_prompts=cfg.rollout.max_batch_prompts,
                           decode_loop=cfg.rollout.hf_decode_loop)


def build_vllm_engine(cfg: Config, plan, eos: int):
    """One vLLM engine per rollout engine, driven by the engine's first rank (None on its other ranks): vLLM runs in
    processes of its own (on GPUs, on the engine's GPUs), fed by the weight-sync group (DESIGN §9)."""
    from hpc_rlhf.engines.rollout.vllm import VLLMRolloutEngine  # vLLM itself is imported only when it starts

    engine_ranks = plan.role("rollout").engines[groups.rollout_engine_of_rank()]
    if dist.get_rank() != engine_ranks[0]:
        return None
    on_gpu = torch.cuda.is_available()
    dtype = cfg.actor.dtype if cfg.actor.dtype != "auto" else ("bfloat16" if on_gpu else "float32")  # the actor's
    eager = not on_gpu if cfg.rollout.enforce_eager is None else cfg.rollout.enforce_eager
    # The engine's GPUs as this rank's CUDA_VISIBLE_DEVICES names them (indices or UUIDs), never raw numbers.
    gpu_ids = engine_visible_devices([r % plan.ranks_per_node for r in engine_ranks], os.environ,
                                     torch.cuda.device_count()).split(",") if on_gpu else None
    return VLLMRolloutEngine(cfg.actor.path, eos, tensor_parallel_size=len(engine_ranks), gpu_ids=gpu_ids,
                             dtype=dtype, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                             kv_cache_mb=cfg.rollout.kv_cache_mb or None, enforce_eager=eager,
                             seed=cfg.train.seed, enable_sleep_mode=plan.is_hybrid,
                             max_model_len=cfg.data.max_prompt_len + longest_response(cfg)[1],
                             lora=cfg.actor.lora if cfg.actor.lora.rank > 0 else None)
