"""Phase 8 of the RL step, weight sync: the actor's new weights reach the rollout engines.

- Disjoint placements: the actor's leader streams the full weights to every rollout rank over the weight-sync
  group, in buckets (dist/weight_sync.py: under ZeRO-3 one module is gathered at a time on every actor rank and
  packed into one of two bucket buffers kept between syncs, sent while the next is gathered); the engines load them
  in place. The layout of the first sync is reused by the next ones (one header per sync).
- Hybrid placement (`rollout@actor`) with the hf engine: the engine generates with the actor's own module, nothing
  moves. With vLLM, the engine (its own weights, its own processes) sleeps while the actor trains and gets the
  actor's weights streamed in locally before it generates, when they changed since it last got them
  (`engine_awake`).
- LoRA actor (`actor.lora.rank > 0`), either placement: the engines hold the frozen base weights, loaded once at
  start-up from the actor's base folder (`actor.path`), and every sync streams the adapter alone, the same way
  (`TrainEngine.adapter_state`: a few MB where the model is GB); each engine applies it to its base
  (`RolloutEngine.load_adapter`: peft on the hf engine's own copy, vLLM's LoRA support). No merged weights travel.

What a sync moved is logged as `weight_sync_mb`: what the actor's leader sent over the weight-sync group, or in
the hybrid vLLM placement what the engine loaded for the step's generation; 0 in the hybrid hf placement.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from hpc_rlhf.dist import groups, weight_sync
from hpc_rlhf.dist.placement import Plan
from hpc_rlhf.engines.rollout.base import hf_named_tensors
from hpc_rlhf.engines.train import TrainEngine


class WeightSync:
    """The actor -> engines path of one rank (every rank holds one; what it does follows from its roles).
    `adapter_only`: the actor trains a LoRA adapter, and the adapter alone travels."""

    def __init__(self, plan: Plan, actor: TrainEngine | None, rollout, backend: str, bucket_mb: float,
                 adapter_only: bool = False):
        self.plan, self.actor, self.rollout = plan, actor, rollout
        self.bucket_mb = bucket_mb
        self.adapter_only = adapter_only
        self.hybrid_vllm = plan.is_hybrid and backend == "vllm"
        # hybrid vLLM: the actor version (optimizer steps, skipped steps) whose weights the engine holds, and the
        # bytes loaded into the engine since the last sync reported them
        self.engine_version: tuple[int, int] | None = None
        self.loaded_bytes = 0

    def _actor_weights(self, on_every_rank: bool = False):
        """What travels: the adapter alone, or the full weights under Hugging Face names."""
        if self.adapter_only:
            return self.actor.adapter_state(on_every_rank=on_every_rank)
        return hf_named_tensors(self.actor.full_state(on_every_rank=on_every_rank))

    def _engine_load(self):
        return self.rollout.load_adapter if self.adapter_only else self.rollout.load_weights

    def sync(self) -> float:
        """Disjoint placements: actor leader -> every rollout rank, streamed in buckets; every rank calls it.
        Returns the megabytes sent (on the leader; 0 elsewhere); in the hybrid placement the megabytes the vLLM
        engine loaded since the last sync (0 with the hf engine)."""
        if self.plan.is_hybrid:
            loaded, self.loaded_bytes = self.loaded_bytes, 0
            return loaded / 2**20
        sent = 0.0
        src = groups.role_leader("actor")
        if self.actor is not None:
            # every actor rank takes part in the gathers; the leader sends each module as it comes
            weights = self._actor_weights()
            if dist.get_rank() == src:
                stats = weight_sync.send_weights(weights, src=src, group=groups.weight_sync_group(),
                                                 bucket_mb=self.bucket_mb, reuse_layout=True)
                sent = stats.bytes / 2**20
            else:
                for _ in weights:
                    pass
        if groups.has_role("rollout"):  # a vLLM engine's other ranks hold no engine (None): they drop the data
            if self.adapter_only:
                load = self.rollout.load_adapter if self.rollout is not None else (lambda named: None)
                weight_sync.receive_weights(src, groups.weight_sync_group(), load)
            else:
                weight_sync.receive_into(self.rollout, src=src, group=groups.weight_sync_group())
        return float(sent)

    @contextlib.contextmanager
    def engine_awake(self) -> Iterator[None]:
        """Around a generation: a hybrid vLLM engine gets the actor's weights (or adapter) when they changed since
        it last got them (one module gathered at a time under ZeRO-3, on every actor rank), wakes, generates, and
        goes back to sleep (a no-op on CPU). Nothing to do in the other placements."""
        if not self.hybrid_vllm:
            yield
            return
        version = (self.actor.global_step, self.actor.skipped_steps)
        if version != self.engine_version:
            weights = self._actor_weights(on_every_rank=True)
            if self.rollout is None:  # a vLLM engine's other ranks take part in the gathers only
                for _ in weights:
                    pass
            else:
                stats = weight_sync.load_local_weights(weights, self._engine_load(), bucket_mb=self.bucket_mb)
                self.loaded_bytes += stats.bytes
            self.engine_version = version
        if self.rollout is None:
            yield
            return
        self.rollout.wake()
        try:
            yield
        finally:
            self.rollout.sleep()
