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


def share(values: Sequence[torch.Tensor] | None, key: str, dtype: torch.dtype = torch.float32
          ) -> list[torch.Tensor] | None:
    """`values` (given on the route's sender; ignored elsewhere) on every rank of route `key`; None on the ranks
    outside it. Every rank of the route must call it, in the same order as the other routes it is on."""
    path = groups.route(key)
    me = dist.get_rank()
    if me not in path.ranks:
        return None
    if len(path.ranks) == 1:
        return list(values)
    if len(path.ranks) == 2:
        if me == path.src:
            exchange.send_ragged(values, path.consumers[0], tag=key, dtype=dtype)
            return list(values)
        return exchange.recv_ragged(path.src, tag=key)
    return exchange.broadcast_ragged(values if me == path.src else None, src=path.src,
                                     group=groups.route_group(key), tag=key, dtype=dtype)


def share_engines(per_engine: Sequence[torch.Tensor] | None, kind: str, engines: int,
                  dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Every engine's list (`per_engine`: this rank's own engine's, on its first rank) along the routes
    `kind/0`, `kind/1`, ..., concatenated in engine order on the ranks that are on every one of them (the
    consumers); None on the others."""
    out: list[torch.Tensor] | None = []
    for index in range(engines):
        got = share(per_engine, f"{kind}/{index}", dtype=dtype)
        out = None if got is None or out is None else out + got
    return out
