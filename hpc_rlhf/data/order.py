"""Which rows a step trains on: a pure function of (number of rows, batch size, step, seed).

The rows of optimizer step `s` are positions `s*batch_size ... (s+1)*batch_size` of an endless stream made of one
seeded permutation per epoch. Every rank computes the same, and a resumed run needs nothing but the step number to
see exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

# Spaces the seeds of the epochs' permutations: (seed, epoch) pairs get distinct generator seeds for every epoch
# below it.
EPOCH_SEED_STRIDE = 1_000_003


def step_indices(num_rows: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step` (pure: the same on every rank and after any resume)."""
    if num_rows <= 0:
        raise ValueError("the data set is empty")
    out: list[int] = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, num_rows)
        generator = torch.Generator().manual_seed(seed * EPOCH_SEED_STRIDE + epoch)
        order = torch.randperm(num_rows, generator=generator).tolist()
        take = min(batch_size - len(out), num_rows - offset)
        out.extend(order[offset:offset + take])
        position += take
    return out


def rank_micro_batches(indices: Sequence[int], rank: int, world: int, micro_batch_size: int,
                       length: Callable[[int], int] | None = None) -> list[list[int]]:
    """This rank's share of a global batch, cut into micro-batches (contiguous shares, in order). With `length`
    (row index -> tokens), the share is sorted by length first (stable: ties keep their order), so that each
    micro-batch pads to a length near its rows' own: the same rows and the same number of micro-batches."""
    if len(indices) % world:
        raise ValueError(f"a batch of {len(indices)} does not divide over {world} ranks")
    per_rank = len(indices) // world
    mine = list(indices[rank * per_rank:(rank + 1) * per_rank])
    if length is not None:
        mine.sort(key=length)
    return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


