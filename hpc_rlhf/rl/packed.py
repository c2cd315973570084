"""The padding-free layout of a micro-batch of samples (rl.padding_free): the samples' real tokens packed into a few
rows, each sample whole in one row, `position_ids` restarting at 0 at each sample, no attention mask; the model
keeps attention within a sample from the restarting positions (hpc_rlhf.data.packing says how on each attention
backend). The conversions between this layout and the padded one of rl/batches.py are pure; the forwards at the
end (a policy's log-probs, a critic's values, a reward model's scores, a process reward model's logits at the
steps) take either layout and answer in the padded one, so that everything after them (losses, advantages, the
exchange) is the same either way.

Rows are at most `row_tokens` long (default: the longest sample of the micro-batch), filled first-fit decreasing.
A row as long as the longest sample keeps each row's attention as cheap as a padded row's (sdpa on CPU attends over
the whole row, masked), while the pads of the short samples are gone; flash-attention's varlen kernel attends within
a sample only, and longer rows cost it nothing.

For a sample i placed in row r at offset o, the model's output at packed position o + t is the padded layout's at
position t: `unpack_tokens` (values, one per token) and `unpack_next_token` (log-probs, entropies: one per position
that predicts a next token) gather back to (B, T) and (B, T-1), 0 outside the samples, differentiably.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.algorithms.logprobs import entropy_from_logits, token_logprobs
from hpc_rlhf.dist import groups
from hpc_rlhf.data.packing import bins_first_fit_decreasing, packed_model_kwargs
from hpc_rlhf.models.sequence_parallel import SequenceContext, SequenceShard, gather_sequence, inner_attention
from hpc_rlhf.models.value_model import normalized_scores, sequence_scores, token_values
from hpc_rlhf.rl import micro_batches
from hpc_rlhf.rl.batches import SampleBatch, response_logprobs


@dataclass
class PackedBatch:
    """A micro-batch's samples in packed rows.

    input_ids, position_ids  (R, L): the rows, right-padded with `pad_id` in blocks whose positions restart at 0
    row, offset              per sample: its row and where it starts there
    lengths                  per sample: prompt + response tokens
    width                    the padded layout's width these samples came from (its T)
    cu_seqlens, max_seqlen   every block's bounds in the flattened rows (flash-attention's varlen kernel)
    """
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row: list[int]
    offset: list[int]
    lengths: list[int]
    width: int
    cu_seqlens: torch.Tensor
    max_seqlen: int

    def model_kwargs(self, attn_implementation: str = "sdpa") -> dict[str, Any]:
        """The forward's keyword arguments (no attention mask, no cache: what makes transformers mask by sample)."""
        return packed_model_kwargs({"input_ids": self.input_ids, "position_ids": self.position_ids,
                                    "cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen},
                                   attn_implementation)

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.row, self.offset,
                           self.lengths, self.width, self.cu_seqlens.to(device), self.max_seqlen)

    def last_token_index(self, length: int | None = None) -> torch.Tensor:
        """(B,) each sample's last token as an index into the flattened rows (a reward model's score); `length`:
        the rows' length there, when padded beyond this batch's (a sequence block's chunks)."""
        length = length or self.input_ids.shape[1]
        return torch.tensor([r * length + o + n - 1 for r, o, n in zip(self.row, self.offset, self.lengths)],
                            dtype=torch.long)


def sample_lengths(batch: SampleBatch) -> list[int]:
    return [p + r for p, r in zip(batch.prompt_lens, batch.response_lens)]


def pack_batch(batch: SampleBatch, pad_id: int, row_tokens: int = 0) -> PackedBatch:
    """A padded batch (rl/batches.py `make_batch`, right-padded) -> its samples packed into rows of at most
    `row_tokens` tokens (0: as many as the longest sample has)."""
    lengths = sample_lengths(batch)
    longest = max(lengths)
    capacity = row_tokens or longest
    if capacity < longest:
        raise ValueError(f"a sample of {longest} tokens does not fit rows of {capacity} tokens "
                         f"(rl.padding_free_row_tokens)")
    bins = bins_first_fit_decreasing(lengths, capacity)
    width = max(sum(lengths[i] for i in members) for members in bins)
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    row, offset = [0] * len(lengths), [0] * len(lengths)
    bounds = [0]
    for r, members in enumerate(bins):
        at = 0
        for i in sorted(members):  # in sample order within a row: the layout depends on the lengths only
            n = lengths[i]
            input_ids[r, at:at + n] = batch.input_ids[i, :n]
            position_ids[r, at:at + n] = torch.arange(n)
            row[i], offset[i] = r, at
            at += n
            bounds.append(r * width + at)
        if at < width:
            position_ids[r, at:] = torch.arange(width - at)
            bounds.append((r + 1) * width)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    return PackedBatch(input_ids, position_ids, row, offset, lengths, batch.input_ids.shape[1], cu_seqlens,
                       int(cu_seqlens.diff().max()))


def _gather_index(packed: PackedBatch, span: int, per_row: int, shrink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, span) indices into the flattened (R, per_row) packed values and the mask of the real ones: sample i's
    position t (t < its length - shrink) sits at row * per_row + offset + t."""
    t = torch.arange(span)
    starts = torch.tensor([r * per_row + o for r, o in zip(packed.row, packed.offset)], dtype=torch.long)
    real = t.unsqueeze(0) < (torch.tensor(packed.lengths) - shrink).unsqueeze(1)
    index = torch.where(real, starts.unsqueeze(1) + t.unsqueeze(0), torch.zeros_like(real, dtype=torch.long))
    return index, real


def unpack_tokens(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(R, L) per-token values of the packed rows -> (B, T) in the padded layout, 0 at padding."""
    index, real = _gather_index(packed, packed.width, values.shape[1], shrink=0)
    out = values.reshape(-1)[index.to(values.device).reshape(-1)].reshape(index.shape)
    return torch.where(real.to(values.device), out, torch.zeros_like(out))


def unpack_next_token(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(R, L-1) per-position values of the packed rows, position t about token t+1 (log-probs, entropies) ->
    (B, T-1) in the padded layout, 0 where a position predicts no token of its own sample."""
    index, real = _gather_index(packed, packed.width - 1, values.shape[1], shrink=1)
    out = values.reshape(-1)[index.to(values.device).reshape(-1)].reshape(index.shape)
    return torch.where(real.to(values.device), out, torch.zeros_like(out))


def processed_tokens(lengths: Sequence[int], micro: int, padding_free: bool, row_tokens: int = 0,
                     micro_tokens: int = 0) -> int:
    """Tokens a forward over these samples processes in micro-batches of `micro` samples (or of at most
    `micro_tokens` tokens, hpc_rlhf/rl/micro_batches.py): each micro-batch padded to its longest sample, or packed
    into rows (`pack_batch`) padded to the longest row. The step logs pad_share = 1 - real tokens / this."""
    total = 0
    for lo, hi in micro_batches.cuts(lengths, micro, micro_tokens):
        part = list(lengths[lo:hi])
        if not padding_free:
            total += len(part) * max(part)
            continue
        bins = bins_first_fit_decreasing(part, row_tokens or max(part))
        total += len(bins) * max(sum(part[i] for i in members) for members in bins)
    return total


# ------------------------------------------------------------------------------------ a role's forward, either way
@dataclass(frozen=True)
class Layout:
    """How a role's micro-batches go through its model: padded rows, or packed ones (rl.padding_free), each
    packed row shared by the ranks of a sequence block (`sequence`: this rank's place in it) when the role is
    sequence-parallel (placement key `<role>_sp=K`, hpc_rlhf.models.sequence_parallel)."""
    padding_free: bool = False
    pad_id: int = 0
    row_tokens: int = 0
    sequence: SequenceShard | None = None

    @property
    def sharded(self) -> bool:
        """Whether forwards run the sequence-parallel attention (a shard of one rank runs it without exchanges:
        benchmarks/sequence_parallel.py compares K ranks with one that way)."""
        return self.sequence is not None

    def with_sequence(self, shard: SequenceShard | None) -> "Layout":
        """This layout for a role whose rows are shared by `shard`'s block (None or size 1: not shared)."""
        if shard is not None and shard.size > 1 and not self.padding_free:
            raise ValueError("sequence parallelism runs on packed rows: set rl.padding_free=true")
        return replace(self, sequence=shard if shard is not None and shard.size > 1 else None)

    @staticmethod
    def of(rl, pad_id: int) -> "Layout":
        """The layout of the RL config's section `rl` (rl.padding_free, rl.padding_free_row_tokens)."""
        return Layout(rl.padding_free, pad_id, rl.padding_free_row_tokens) if rl.padding_free else PADDED

    def pack(self, sub: SampleBatch) -> PackedBatch:
        return pack_batch(sub, self.pad_id, self.row_tokens).to(sub.input_ids.device)


PADDED = Layout()


def role_layouts(layout: Layout, roles: Sequence[str]) -> dict[str, Layout]:
    """`layout` for each of `roles` this rank holds, with the rank's sequence block where the role has one
    (placement key `<kind>_sp`; hpc_rlhf.dist.groups made the blocks' groups)."""
    layouts = {}
    for role in roles:
        if not groups.has_role(role):
            continue
        block = groups.sequence_ranks(role)
        layouts[role] = layout if len(block) == 1 else layout.with_sequence(
            SequenceShard(groups.sequence_group(role), len(block), block.index(dist.get_rank())))
    return layouts


def attention_of(model) -> str:
    """The attention backend of a model, its peft wrapper or its engine (what the packed kwargs depend on)."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    return inner_attention(getattr(getattr(inner, "config", None), "_attn_implementation", None))


@dataclass
class _Chunk:
    """This rank's chunk of packed rows shared by a sequence block: the rows padded to a multiple of the block
    size (`input_ids`, R x L), the forward's keyword arguments for the chunk [start, end), and the labels of its
    positions (each position's next token in the whole row; the pad id after the row's end)."""
    input_ids: torch.Tensor
    start: int
    end: int
    kwargs: dict[str, Any]

    def labels(self, pad_id: int) -> torch.Tensor:
        following = torch.cat([self.input_ids[:, 1:], torch.full_like(self.input_ids[:, :1], pad_id)], dim=1)
        return following[:, self.start:self.end]


def _chunk(packed: PackedBatch, shard: SequenceShard, pad_id: int) -> _Chunk:
    rows, width = packed.input_ids.shape
    extra = -width % shard.size
    input_ids, position_ids = packed.input_ids, packed.position_ids
    if extra:  # a block of pad tokens of its own (positions restarting at 0), attended by nothing real
        input_ids = torch.cat([input_ids, input_ids.new_full((rows, extra), pad_id)], dim=1)
        tail = torch.arange(extra, device=position_ids.device).expand(rows, extra)
        position_ids = torch.cat([position_ids, tail], dim=1)
    start, end = shard.bounds(input_ids.shape[1])
    kwargs = {"input_ids": input_ids[:, start:end], "position_ids": position_ids[:, start:end],
              "sequence_context": SequenceContext(shard, position_ids)}
    return _Chunk(input_ids, start, end, kwargs)


def _block_values(model, packed: PackedBatch, layout: Layout, head=None) -> torch.Tensor:
    """(R, L) a value model's per-token values of the whole rows, each rank of the block computing its chunk (L:
    the rows' length padded to a multiple of the block size)."""
    chunk = _chunk(packed, layout.sequence, layout.pad_id)
    return gather_sequence(token_values(model, attention_mask=None, head=head, **chunk.kwargs), layout.sequence)


def policy_forward(model, sub: SampleBatch, temperature: float, layout: Layout = PADDED
                   ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(B, T-1) log-probs of each next token under softmax(logits / T), and a function giving the entropies of
    those distributions (B, T-1) (called under the grad mode the caller wants): the padded layout either way."""
    if not layout.padding_free:
        logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False).logits.float()
        return (response_logprobs(logits, sub, temperature),
                lambda: entropy_from_logits(logits[:, :-1] / temperature))
    packed = layout.pack(sub)
    if layout.sharded:
        chunk = _chunk(packed, layout.sequence, layout.pad_id)
        logits = model(**chunk.kwargs, use_cache=False).logits.float()
        mine = token_logprobs(logits, chunk.labels(layout.pad_id), temperature=temperature)
        return (unpack_next_token(gather_sequence(mine, layout.sequence)[:, :-1], packed),
                lambda: unpack_next_token(gather_sequence(entropy_from_logits(logits / temperature),
                                                          layout.sequence)[:, :-1], packed))
    logits = model(**packed.model_kwargs(attention_of(model))).logits.float()
    logps = token_logprobs(logits[:, :-1], packed.input_ids[:, 1:], temperature=temperature)
    return (unpack_next_token(logps, packed),
            lambda: unpack_next_token(entropy_from_logits(logits[:, :-1] / temperature), packed))


def value_forward(model, sub: SampleBatch, layout: Layout = PADDED, head=None) -> torch.Tensor:
    """(B, T) value of every token under a value model (0 at padding): the padded layout either way."""
    if not layout.padding_free:
        return token_values(model, sub.input_ids, sub.attention_mask, head=head)
    packed = layout.pack(sub)
    if layout.sharded:
        return unpack_tokens(_block_values(model, packed, layout, head), packed)
    kwargs = packed.model_kwargs(attention_of(model))
    kwargs.pop("use_cache")
    return unpack_tokens(token_values(model, attention_mask=None, head=head, **kwargs), packed)


def score_forward(model, sub: SampleBatch, normalize: bool, layout: Layout = PADDED) -> torch.Tensor:
    """(B,) a reward model's score of each sample: the value at its last token."""
    if not layout.padding_free:
        return sequence_scores(model, sub.input_ids, sub.attention_mask, normalize=normalize)
    packed = layout.pack(sub)
    if layout.sharded:
        values = _block_values(model, packed, layout)
        last = packed.last_token_index(values.shape[1]).to(values.device)
        return normalized_scores(model, values.reshape(-1)[last], normalize)
    kwargs = packed.model_kwargs(attention_of(model))
    kwargs.pop("use_cache")
    values = token_values(model, attention_mask=None, **kwargs)
    return normalized_scores(model, values.reshape(-1)[packed.last_token_index().to(values.device)], normalize)


def logits_at(model, sub: SampleBatch, positions: Sequence[Sequence[int]], layout: Layout = PADDED) -> torch.Tensor:
    """(N, V) a causal LM's logits at the given places of the samples: `positions[i]` the columns of sample i in
    the padded layout; the N rows of the answer sample by sample, each sample's in the order given (a process
    reward model's markers, runtime/process_rewards.py). Not for a role on a sequence block."""
    if layout.sharded:
        raise ValueError("logits at chosen positions are computed on whole rows: not on a sequence block")
    samples = [i for i, found in enumerate(positions) for _ in found]
    columns = [j for found in positions for j in found]
    device = sub.input_ids.device
    if not layout.padding_free:
        logits = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask, use_cache=False).logits
        return logits[torch.tensor(samples, dtype=torch.long, device=device),
                      torch.tensor(columns, dtype=torch.long, device=device)]
    packed = layout.pack(sub)
    logits = model(**packed.model_kwargs(attention_of(model))).logits
    width = logits.shape[1]
    flat = torch.tensor([packed.row[i] * width + packed.offset[i] + j for i, j in zip(samples, columns)],
                        dtype=torch.long, device=logits.device)
    return logits.reshape(-1, logits.shape[-1])[flat]
