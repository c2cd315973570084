"""How a rank's share of an RL step's samples is cut into micro-batches, for scoring's forwards and training's
forward-backward passes: `micro_batch_size` samples at a time, or, with `rl.micro_batch_tokens`, as many
consecutive samples as fit that many tokens (prompt + response; a longer sample goes alone). Lengths are long-tailed
in reasoning and agent RL; a fixed count of samples then makes micro-batches of very unequal work, and the budget
of the longest one sets the memory every other one could have used.

Pure functions of the samples' lengths: every rank of a role knows every sample's length, so it computes every
replica's cuts without a message, and all of them run as many passes, which a ZeRO-3 model needs (it gathers its
parameters collectively in each). Consecutive cuts keep each micro-batch's samples in the order the caller gave
(scoring's results return in sample order; training's order is its seeded shuffle).
"""

from __future__ import annotations

from typing import Sequence


def cuts(lengths: Sequence[int], samples: int, tokens: int = 0) -> list[tuple[int, int]]:
    """[start, end) of consecutive micro-batches over samples of `lengths`: `samples` at a time when `tokens` is
    0, else each as many samples as fit `tokens` tokens (at least one)."""
    if samples < 1 or tokens < 0:
        raise ValueError(f"micro-batches of {samples} samples / {tokens} tokens")
    n = len(lengths)
    if not tokens:
        return [(lo, min(lo + samples, n)) for lo in range(0, n, samples)]
    out, lo, used = [], 0, 0
    for i, length in enumerate(lengths):
        if i > lo and used + length > tokens:
            out.append((lo, i))
            lo, used = i, 0
        used += length
    if lo < n:
        out.append((lo, n))
    return out


def split_to(parts: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """`parts` cut further until there are `count`: the one of most samples (the first of those) halved each
    time; every part still fits the budget it fitted. For a replica with fewer micro-batches than its peers."""
    parts = list(parts)
    while len(parts) < count:
        widest = max(range(len(parts)), key=lambda k: parts[k][1] - parts[k][0])
        lo, hi = parts[widest]
        if hi - lo < 2:
            raise ValueError(f"{sum(b - a for a, b in parts)} samples cannot make {count} micro-batches")
        mid = lo + (hi - lo + 1) // 2
        parts[widest:widest + 1] = [(lo, mid), (mid, hi)]
    return parts


def passes(shards: Sequence[Sequence[int]], samples: int, tokens: int = 0) -> int:
    """Passes every rank of a role runs: the most micro-batches any replica's shard (its samples' lengths) needs."""
    return max((len(cuts(lengths, samples, tokens)) for lengths in shards), default=0)
