"""Every rank of a group agreeing on a yes/no: the one way the recipes decide together (stop after this step, skip
a non-finite step, another dynamic-sampling round, a manifest that does not match), so that no rank is left
waiting in a collective its peers have decided to skip.

One all-reduce of small integers on the communication device (NCCL reduces CUDA tensors only)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hpc_rlhf.dist.exchange import comm_device


def any_rank(flags: Sequence[bool | None], group=None) -> list[bool]:
    """For each flag, whether it is set on any rank of `group` (None counts as not set): one all-reduce for all."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def decided_by(rank: int, flag: bool | None, group=None) -> bool:
    """`flag` as global rank `rank` holds it, on every rank of `group` (what the others pass is ignored)."""
    return any_rank([bool(flag) and dist.get_rank() == rank], group)[0]

