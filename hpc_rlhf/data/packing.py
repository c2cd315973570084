"""Sample packing: several tokenised examples share one row, without seeing each other.

A packed row is the examples' tokens one after another, with `position_ids` restarting at 0 at each example.
That is all the model needs to keep examples apart:

- sdpa / eager (CPU and GPU): transformers (checked with 5.23, `masking_utils.find_packed_sequence_indices`)
  reads restarting position ids as packed sequences and builds a block-diagonal causal mask by itself, but
  only when no `attention_mask` is given AND there is no KV cache. A model called with its default
  `use_cache=True` creates an empty cache, the detection is skipped and examples attend across boundaries.
  So call the model with `packed_model_kwargs(batch)`, which passes `use_cache=False` and no attention mask.
- flash_attention_2: the same position ids select flash-attn's varlen kernel; `packed_model_kwargs` also passes
  the sequence boundaries (`cu_seq_lens_q/k`, `max_length_q/k`), which lets the kernel work on several padded
  rows at once and spares it recomputing the boundaries in every layer.

Labels: the label of each example's first token is -100. The model predicts token t+1 from token t, so without
that the last token of one example would be trained to predict the first token of the next.

Padding at the end of a row forms a block of its own (positions restart at 0, labels -100): real tokens never
attend to it, because it comes after them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from hpc_rlhf.data.examples import IGNORE_INDEX

STRATEGIES = ("first_fit_decreasing", "sequential")


def bins_first_fit_decreasing(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Item indices grouped into bins of at most `max_len` in total, longest first into the first bin with room."""
    # Longest first, ties by position: the result depends only on the lengths, so every rank agrees on it.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_len - lengths[i])
    return bins


def _bins_sequential(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    bins: list[list[int]] = []
    used = max_len
    for i, n in enumerate(lengths):
        if used + n > max_len:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def pack_examples(examples: Sequence[Mapping[str, Any]], max_len: int,
                  strategy: str = "first_fit_decreasing") -> list[dict[str, Any]]:
    """Examples ({"input_ids", optional "labels"}) -> packed rows of at most max_len tokens.

    Each row: input_ids, labels (first token of each example -100), position_ids (restarting at 0),
    cu_seqlens ([0, end of example 1, end of example 2, ...]) and example_indices (which examples, in order).
    first_fit_decreasing fills rows best; sequential keeps the examples' order. Both are deterministic.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"packing strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    lengths = [len(example["input_ids"]) for example in examples]
    for i, n in enumerate(lengths):
        if n == 0 or n > max_len:
            raise ValueError(f"example {i} has {n} tokens; packing needs 1..max_len={max_len} "
                             f"(truncate examples before packing)")
    bins = (bins_first_fit_decreasing if strategy == "first_fit_decreasing" else _bins_sequential)(lengths,
                                                                                                   max_len)
    rows = []
    for members in bins:
        row = {"input_ids": [], "labels": [], "position_ids": [], "cu_seqlens": [0], "example_indices": members}
        for i in members:
            ids = list(examples[i]["input_ids"])
            labels = list(examples[i].get("labels", ids))
            if len(labels) != len(ids):
                raise ValueError(f"example {i} has {len(ids)} input_ids but {len(labels)} labels")
            labels[0] = IGNORE_INDEX
            row["input_ids"] += ids
            row["labels"] += labels
            row["position_ids"] += list(range(len(ids)))
            row["cu_seqlens"].append(row["cu_seqlens"][-1] + len(ids))
        rows.append(row)
    return rows


def packed_collate(rows: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, Any]:
    """Packed rows -> tensors input_ids, labels, position_ids [B, L] (padded on the right), plus
    cu_seqlens (int32) and max_seqlen: the boundaries of every block, example or padding, in the flattened
    [B * L] token stream, as flash-attn's varlen kernel wants them.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    length = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    boundaries = [0]
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[r, :n] = torch.as_tensor(row["input_ids"])
        labels[r, :n] = torch.as_tensor(row["labels"])
        position_ids[r, :n] = torch.as_tensor(row["position_ids"])
        position_ids[r, n:] = torch.arange(length - n)
        offset = r * length
        boundaries += [offset + end for end in row["cu_seqlens"][1:]]
        if n < length:
            boundaries.append(offset + length)
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(cu_seqlens.diff().max()),
        "num_sequences": sum(len(row["cu_seqlens"]) - 1 for row in rows),
    }


def packed_model_kwargs(batch: Mapping[str, Any], attn_implementation: str = "sdpa") -> dict[str, Any]:
    """The keyword arguments for a transformers model's forward on a packed batch (see the module docstring)."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if attn_implementation.startswith("flash_attention"):
        kwargs.update(cu_seq_lens_q=batch["cu_seqlens"], cu_seq_lens_k=batch["cu_seqlens"],
                      max_length_q=batch["max_seqlen"], max_length_k=batch["max_seqlen"])
    return kwargs


def padding_efficiency(rows: Sequence[Mapping[str, Any]], batch_size: int | None = None) -> float:
    """Real tokens / processed tokens when `rows` are fed in order, `batch_size` at a time (default: all at once),
    each batch padded to its longest row. Works for packed rows and for plain examples alike."""
    lengths = [len(row["input_ids"]) for row in rows]
    if not lengths:
        raise ValueError("no rows")
    size = batch_size or len(lengths)
    processed = sum(len(lengths[i:i + size]) * max(lengths[i:i + size]) for i in range(0, len(lengths), size))
    return sum(lengths) / processed
