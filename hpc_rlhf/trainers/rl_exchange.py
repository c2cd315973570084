"""Experience messages of the RL step, each to the ranks that consume it (DESIGN §4.3).

A message kind has a route (`hpc_rlhf.dist.groups.route`): its sender and its consumers, a pure function of the
placement. `share` moves one ragged list along a route: nothing when the sender is its only consumer, a
point-to-point send to a single consumer, a broadcast over the route's group otherwise. Ranks outside the route
take no part and get None.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.dist import exchange, groups


def share(values: Sequence[torch.Tensor] | None, key: str, dtype: torch.dtype = torch.float32,
          lengths: Sequence[int] | None = None) -> list[torch.Tensor] | None:
    """`values` (given on the route's sender; ignored elsewhere) on every rank of route `key`; None on the ranks
    outside it. Every rank of the route must call it, in the same order as the other routes it is on.

    `lengths`: the length of every value, when every rank of the route knows them already (per-token results of
    responses that all of them hold, one score per sample): the values then travel as one flat message without
    a header (`exchange.broadcast_known`)."""
    path = groups.route(key)
    me = dist.get_rank()
    if me not in path.ranks:
        return None
    if len(path.ranks) == 1:
        return list(values)
    if lengths is not None:
        return _share_known(values, path, key, dtype, list(lengths))
    if len(path.ranks) == 2:
        if me == path.src:
            exchange.send_ragged(values, path.consumers[0], tag=key, dtype=dtype)
            return list(values)
        return exchange.recv_ragged(path.src, tag=key)
    return exchange.broadcast_ragged(values if me == path.src else None, src=path.src,
                                     group=groups.route_group(key), tag=key, dtype=dtype)


def _share_known(values, path: groups.Route, key: str, dtype: torch.dtype, lengths: list[int]) -> list[torch.Tensor]:
    total, me = sum(lengths), dist.get_rank()
    flat = None
    if me == path.src:
        if values is None or len(values) != len(lengths):
            got = "none" if values is None else len(values)
            raise exchange.ExchangeError(f"share('{key}'): {got} values for {len(lengths)} samples")
        flat = torch.cat([v.reshape(-1) for v in values]) if values else torch.zeros(0, dtype=dtype)
    if len(path.ranks) == 2:
        if me == path.src:
            exchange.send_known(flat, path.consumers[0], total, dtype, tag=key)
        else:
            flat = exchange.recv_known(path.src, total, dtype)
    else:
        flat = exchange.broadcast_known(flat, path.src, groups.route_group(key), total, dtype, tag=key)
    return list(torch.split(flat, lengths))


def share_engines(per_engine: Sequence[torch.Tensor] | None, kind: str, engines: int, dtype: torch.dtype,
                  lengths: Sequence[Sequence[int] | None] | None = None) -> list[list[torch.Tensor] | None]:
    """Every engine's list (`per_engine`: this rank's own engine's, on its first rank) along the routes
    `kind/0`, `kind/1`, ...: per engine, its list on the ranks of its route, None elsewhere. `lengths[e]`: the
    lengths of engine e's values where the route's ranks know them (see `share`)."""
    return [share(per_engine, f"{kind}/{index}", dtype=dtype, lengths=lengths[index] if lengths else None)
            for index in range(engines)]


def concatenated(per_engine: list[list[torch.Tensor] | None]) -> list[torch.Tensor] | None:
    """The engines' lists in engine order, on the ranks that got every one of them; None elsewhere."""
    if any(part is None for part in per_engine):
        return None
    return [t for part in per_engine for t in part]
