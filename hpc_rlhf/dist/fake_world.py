"""A torch.distributed world that moves no data, and a record of what the code asks of it: how the real set-up of
a job of a thousand ranks is run in one process (hpc-rlhf simulate, tests).

`as_rank(rank, world_size)` makes this process rank `rank` of a `world_size`-rank world for the duration of a
block, on torch's fake process-group backend: `new_group` works and every collective or point-to-point call
returns at once, its output untouched. Visiting the ranks one after another runs every rank's code.

`Recorder` wraps torch.distributed's calls while `recording()` is active and notes, per call, what this rank sends
and receives (logical bytes: a broadcast of n bytes to k ranks is k x n sent by its root and n received by each;
how a backend routes them, a ring or a tree, is not modelled), the group it runs on and its peer, under the name
of the current `phase`. The calls recorded are those the package makes: `new_group`, `broadcast`, `gather`,
`all_gather`, `all_reduce`, `barrier`, `send`, `recv`, `isend`, `irecv`. An `all_gather` or `gather` hands its
receiver copies of this rank's own tensor, as if every rank had sent the same (so the headers of
hpc_rlhf.dist.exchange's gathers read as valid and the call goes on: a rank's results are then as many as its own
times the group's size); nothing else writes into a buffer.

torch's fake backend lives in an internal module (`torch.testing._internal.distributed.fake_pg`, measured with
torch 2.13): its import is here and nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

BACKEND = "fake"


def fake_store():
    """torch's in-process store for the fake backend (internal to torch: the one place that imports it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # internal module: imported only here

    return FakeStore()


@contextlib.contextmanager
def as_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank `rank` of a fake world of `world_size` ranks inside the block."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed world is already initialised in this process; a fake world needs "
                           "the process to itself")
    dist.init_process_group(BACKEND, store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass
class Call:
    op: str
    phase: str
    group: tuple[int, ...]  # the ranks of the group the call runs on (point to point: the two ranks)
    peer: int | None  # point to point: the other rank; broadcast: the root; gather: the destination
    nbytes: int  # the size of this rank's tensor: one message
    sent: int
    received: int


@dataclasses.dataclass
class NewGroup:
    ranks: tuple[int, ...]
    desc: str
    local: bool  # use_local_synchronization: only the members take part


class Recorder:
    """What one rank's code asked of torch.distributed (see the module docstring); `calls` and `new_groups` are
    this rank's, emptied by `reset`."""

    def __init__(self):
        self.calls: list[Call] = []
        self.new_groups: list[NewGroup] = []
        self.current = "setup"

    def reset(self) -> None:
        self.calls, self.new_groups, self.current = [], [], "setup"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def recording(self) -> Iterator["Recorder"]:
        originals = {name: getattr(dist, name) for name in _WRAPPERS}
        for name, wrap in _WRAPPERS.items():
            setattr(dist, name, wrap(self, originals[name]))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def note(self, op: str, group, peer: int | None, tensor: torch.Tensor, sent: int, received: int) -> None:
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        self.calls.append(Call(op, self.current, ranks, peer, _nbytes(tensor), sent, received))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _kwarg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _wrap_new_group(rec: Recorder, original: Callable) -> Callable:
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        ranks = _kwarg(args, kwargs, 0, "ranks")
        ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
        rec.new_groups.append(NewGroup(ranks, str(kwargs.get("group_desc") or ""),
                                       bool(kwargs.get("use_local_synchronization", False))))
        return group
    return new_group


def _wrap_broadcast(rec: Recorder, original: Callable) -> Callable:
    def broadcast(tensor, src=None, group=None, async_op=False, **kwargs):
        n = _nbytes(tensor)
        root = src if src is not None else kwargs.get("group_src")
        mine = dist.get_rank() == root
        rec.note("broadcast", group, root, tensor, n * (_size(group) - 1) if mine else 0, 0 if mine else n)
        return original(tensor, src, group=group, async_op=async_op, **kwargs)
    return broadcast


def _wrap_gather(rec: Recorder, original: Callable) -> Callable:
    def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, **kwargs):
        n = _nbytes(tensor)
        mine = dist.get_rank() == dst
        rec.note("gather", group, dst, tensor, 0 if mine else n, n * (_size(group) - 1) if mine else 0)
        work = original(tensor, gather_list, dst, group=group, async_op=async_op, **kwargs)
        for out in gather_list or ():  # as if every rank had sent what this one sends (see the module docstring)
            out.copy_(tensor)
        return work
    return gather


def _wrap_all_gather(rec: Recorder, original: Callable) -> Callable:
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        n = _nbytes(tensor)
        others = _size(group) - 1
        rec.note("all_gather", group, None, tensor, n * others, n * others)
        work = original(tensor_list, tensor, group=group, async_op=async_op)
        for out in tensor_list:  # as if every rank had sent what this one sends (see the module docstring)
            out.copy_(tensor)
        return work
    return all_gather


def _wrap_all_reduce(rec: Recorder, original: Callable) -> Callable:
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = _nbytes(tensor)
        rec.note("all_reduce", group, None, tensor, n, n)
        return original(tensor, op=op, group=group, async_op=async_op)
    return all_reduce


def _wrap_barrier(rec: Recorder, original: Callable) -> Callable:
    def barrier(group=None, async_op=False, device_ids=None):
        rec.note("barrier", group, None, torch.empty(0), 0, 0)
        return original(group=group, async_op=async_op, device_ids=device_ids)
    return barrier


def _wrap_point_to_point(op: str, sending: bool) -> Callable:
    def wrap(rec: Recorder, original: Callable) -> Callable:
        def call(tensor, peer=None, group=None, tag=0, **kwargs):
            n = _nbytes(tensor)
            pair = tuple(sorted((dist.get_rank(), peer)))
            rec.calls.append(Call(op, rec.current, pair, peer, n, n if sending else 0, 0 if sending else n))
            return original(tensor, peer, group=group, tag=tag, **kwargs)
        return call
    return wrap


_WRAPPERS: dict[str, Callable[[Recorder, Callable], Callable]] = {
    "new_group": _wrap_new_group, "broadcast": _wrap_broadcast, "gather": _wrap_gather,
    "all_gather": _wrap_all_gather, "all_reduce": _wrap_all_reduce, "barrier": _wrap_barrier,
    "send": _wrap_point_to_point("send", True), "isend": _wrap_point_to_point("isend", True),
    "recv": _wrap_point_to_point("recv", False), "irecv": _wrap_point_to_point("irecv", False),
}
