"""Sequence parallelism of degree K for a transformers model (placement keys `actor_sp=K`, `critic_sp=K`, ...):
the K ranks of a block share one packed row, each holding a contiguous 1/K of its tokens (Ulysses-style).

Everything in a transformer layer but attention works token by token, so each rank runs it on its own chunk.
Attention needs the whole sequence: before it, an all-to-all over the block turns (all heads, own chunk) into
(1/K of the heads, whole sequence); attention runs on those heads; a second all-to-all turns the result back.
Activations per rank fall by about K; each layer moves its q, k, v and output once each way.

`enable(model)` switches a model's attention to the wrapper registered here (`sequence_parallel_sdpa`, or
`sequence_parallel_flash_attention_2` on GPUs): a forward without a `sequence_context` keyword runs the original
attention unchanged (generation, padded batches), one with it runs the sharded attention. The context carries
what a chunk cannot know: the block, and the whole row's position ids (attention stays within a sample, whose
positions restart at 0, as on packed rows without sequence parallelism).

`gather_sequence` puts the per-token outputs of the chunks (log-probs, values) back together on every rank of the
block. Every rank then computes the same loss from the same whole row, so its backward hands each rank the
gradient of its own chunk only; the ranks' parameter gradients are parts of one sum, which the role's
data-parallel all-reduce adds up (hpc_rlhf/rl/training.py scales the loss as without sequence parallelism).

Key/value heads: with K dividing their count each rank receives its own; otherwise (grouped-query attention with
fewer key/value heads than K, K dividing the query heads) they are repeated to one per query head before the
all-to-all, at the cost of more bytes moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

PREFIX = "sequence_parallel_"
INNER_BACKENDS = ("sdpa", "flash_attention_2", "eager")


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sequence block: the block's group, its size K and this rank's index in it."""
    group: dist.ProcessGroup | None
    size: int
    index: int

    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's chunk [start, end) of a row of `length` tokens (a multiple of the block size)."""
        if length % self.size:
            raise ValueError(f"a row of {length} tokens does not split into {self.size} equal chunks")
        chunk = length // self.size
        return self.index * chunk, (self.index + 1) * chunk


@dataclass
class SequenceContext:
    """What the sharded attention of one forward needs: the block, and the whole rows' position ids (R, L)."""
    shard: SequenceShard
    position_ids: torch.Tensor
    _bounds: list[list[tuple[int, int]]] | None = field(default=None, repr=False)

    def sample_bounds(self) -> list[list[tuple[int, int]]]:
        """Per row, each sample's [start, end) (a sample starts where the position ids restart at 0): attention
        runs within each, causal. Found once per forward, shared by the layers."""
        if self._bounds is None:
            length = self.position_ids.shape[1]
            self._bounds = []
            for row in self.position_ids.cpu():
                starts = torch.nonzero(row == 0).reshape(-1).tolist()
                if not starts or starts[0] != 0:
                    starts = [0, *starts]
                self._bounds.append(list(zip(starts, [*starts[1:], length])))
        return self._bounds

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """Every sample's bounds in the flattened rows and the longest sample (flash-attention's varlen kernel)."""
        flat = self.position_ids.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1)
        rows, length = self.position_ids.shape
        row_starts = torch.arange(rows, device=flat.device) * length
        bounds = torch.unique(torch.cat([starts, row_starts, torch.tensor([rows * length], device=flat.device)]))
        return bounds.to(torch.int32), int(bounds.diff().max())


class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 goes to rank j; block i of the result came from rank i. Its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # of x's layout: all_to_all_single fills memory in order
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSequence(torch.autograd.Function):
    """The chunks of dim 1 of every rank of the block, in rank order; backward keeps this rank's chunk's gradient
    (every rank computes the same function of the whole: the module docstring says why that is the gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        ctx.shard, ctx.chunk = shard, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x, group=shard.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.shard.index * ctx.chunk
        return grad[:, start:start + ctx.chunk], None


def gather_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(R, L/K, ...) this rank's chunk -> (R, L, ...) the whole rows, differentiably."""
    return x if shard.size == 1 else _GatherSequence.apply(x, shard)


def _exchange(x: torch.Tensor, shard: SequenceShard, split: int, join: int) -> torch.Tensor:
    """The block's all-to-all: x cut into K parts along dim `split`, part j sent to rank j; the parts received,
    rank by rank, joined along dim `join`."""
    if shard.size == 1:
        return x
    got = _AllToAll.apply(torch.stack(x.chunk(shard.size, dim=split)), shard.group)
    return torch.cat(got.unbind(0), dim=join)


def heads_to_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(R, H, L/K, D) all heads of this rank's chunk -> (R, H/K, L, D) this rank's heads of the whole rows."""
    return _exchange(x, shard, split=1, join=2)


def sequence_to_heads(y: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(R, L, H/K, D) this rank's heads of the whole rows -> (R, L/K, H, D) all heads of this rank's chunk."""
    return _exchange(y, shard, split=1, join=2)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """(R, h, L, D) -> (R, h * times, L, D), each key/value head repeated for the query heads that read it."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def _sharded_attention(inner: str, module, query, key, value, context: SequenceContext, dropout: float,
                       scaling: float | None) -> torch.Tensor:
    shard = context.shard
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % shard.size:
        raise ValueError(f"sequence parallelism of {shard.size} ranks needs a multiple of {shard.size} attention "
                         f"heads; the model has {heads}")
    if kv_heads % shard.size:
        key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
    q, k, v = (heads_to_sequence(t, shard) for t in (query, key, value))
    k, v = _repeat_heads(k, q.shape[1] // k.shape[1]), _repeat_heads(v, q.shape[1] // v.shape[1])
    dropout = dropout if module.training else 0.0
    if inner.startswith("flash_attention"):
        out = _flash_varlen(q, k, v, context, dropout, scaling)  # (R, L, H/K, D)
    else:
        out = _attention_by_sample(q, k, v, context, dropout, scaling)
    return sequence_to_heads(out, shard)


def _attention_by_sample(q, k, v, context: SequenceContext, dropout: float, scaling: float | None) -> torch.Tensor:
    """(R, h, L, D) each -> (R, L, h, D): causal attention within each sample of each row, one sdpa call per
    sample. A mask over the whole row would cost L x L per layer, which sequence parallelism does not divide."""
    rows = []
    for r, bounds in enumerate(context.sample_bounds()):
        rows.append(torch.cat([F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b],
                                                              v[r:r + 1, :, a:b], dropout_p=dropout, is_causal=True,
                                                              scale=scaling)
                               for a, b in bounds], dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2)


def _flash_varlen(q, k, v, context: SequenceContext, dropout: float, scaling: float | None) -> torch.Tensor:
    """flash-attention 2's varlen kernel over the whole rows' samples (GPU only; imported here, never on CPU)."""
    from flash_attn import flash_attn_varlen_func

    rows, heads, length, dim = q.shape
    cu_seqlens, longest = context.cu_seqlens()
    flat = [t.transpose(1, 2).reshape(rows * length, heads, dim) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest,
                                 max_seqlen_k=longest, dropout_p=dropout, softmax_scale=scaling, causal=True)
    return out.reshape(rows, length, heads, dim)


def _attention_for(inner: str):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  sequence_context: SequenceContext | None = None, **kwargs):
        if sequence_context is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            original = ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager" else _eager(module)
            # transformers' flash path looks its kernel up by the config's implementation name, which is ours
            # here: the inner backend's name while it runs
            config = getattr(module, "config", None)
            wrapped = getattr(config, "_attn_implementation", None)
            if config is not None and wrapped != inner:
                config._attn_implementation = inner
            try:
                return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)
            finally:
                if config is not None and wrapped != inner:
                    config._attn_implementation = wrapped
        out = _sharded_attention(inner, module, query, key, value, sequence_context, dropout, scaling)
        return out, None
    attention.__name__ = f"{PREFIX}{inner}"
    return attention


def _eager(module):
    import importlib

    return importlib.import_module(type(module).__module__).eager_attention_forward


_REGISTERED: set[str] = set()


def _register(inner: str) -> str:
    """Register the wrapper of `inner` with transformers' attention and mask interfaces (once per process)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = f"{PREFIX}{inner}"
    if name not in _REGISTERED:
        AttentionInterface.register(name, _attention_for(inner))
        # Forwards without a context mask as the inner backend does; sharded ones build their own mask.
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        _REGISTERED.add(name)
    assert name in ALL_ATTENTION_FUNCTIONS
    return name


def inner_attention(name: str | None) -> str:
    """The backend a (possibly wrapped) attention implementation runs: `sequence_parallel_sdpa` -> `sdpa`."""
    name = name or "sdpa"
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _configs(model):
    """The transformers configs under a model, its peft wrapper or its engine (the text model's and its own)."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    seen = []
    for module in inner.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and all(config is not c for c in seen):
            seen.append(config)
    return seen


def enable(model) -> str:
    """Switch `model`'s attention to the sequence-parallel wrapper of its current backend (idempotent); returns
    the wrapper's name. Forwards without a `sequence_context` are unchanged."""
    configs = _configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} has no transformers config: sequence parallelism wraps the "
                         "attention of transformers models only")
    inner = inner_attention(configs[0]._attn_implementation)
    if inner not in INNER_BACKENDS:
        raise ValueError(f"sequence parallelism runs on attention backends {INNER_BACKENDS}; the model uses "
                         f"'{inner}'")
    name = _register(inner)
    for config in configs:
        config._attn_implementation = name
    return name
