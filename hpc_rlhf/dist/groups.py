"""The process groups of a placement, created once and held here (the only module that creates groups).

`initialize(plan, message_groups)` must be called by every rank of an initialised torch.distributed world, with the
same arguments (pure functions of the placement, so every rank has them). It creates, in this order on every rank,
because `new_group` must be entered by every rank of the world in the same order or the next one hangs:

1. one group per model role, in plan order (actor, critic, ref, reward, reward2, ...): the data-parallel group
   DeepSpeed uses for that role. Colocated roles (`actor+ref`) get separate groups over the same ranks, so
   their collectives never mix. Rollout engines get none: nothing runs collectives among an engine's ranks
   (a vLLM engine of several GPUs is driven by its first rank through vLLM's own processes);
2. one group per sequence block of every role with `<kind>_sp` > 1 (Plan.sequence_blocks): the K consecutive
   ranks of the role that share one packed row and exchange attention heads by all-to-all every layer;
3. the weight-sync group: the actor leader plus every rollout rank. The leader gathers the trained weights
   and broadcasts them over it. With the hybrid engine (`rollout@actor`) the rollout ranks are the actor's
   own ranks, so the group has the same members as the actor group (a separate handle);
4. one group per set of ranks in `message_groups` (name -> ranks), in sorted order of their rank lists; names
   with the same ranks share one group. What the names mean, and which message travels over which group, is
   the caller's: for the RL step, hpc_rlhf/rl/messages.py (its route table).

The list and its order are a pure function of the plan and the message groups (hpc_rlhf.dist.group_layout, which
`hpc-rlhf plan` counts communicators from without torch); this module creates exactly that list.

Every group carries a `group_desc` (`role/actor`, `sequence/actor/0`, `weight_sync`, the message group's name), so that NCCL's and
torch's own messages about a group say which one it is.

DeepSpeed's model-parallel group (a single rank) is created by the rank alone, with local synchronization,
in `engines.deepspeed_compat.singleton_group`, so no per-rank groups are made here.

A collective on a group this rank is not in silently returns None in torch, so asking for such a group here
raises `NotInGroupError` instead of handing out a handle that would do nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping, Sequence

import torch.distributed as dist

from hpc_rlhf.dist import group_layout
from hpc_rlhf.dist.placement import Plan, PlacementError, format_ranks, role_kind

class NotInGroupError(RuntimeError):
    """This rank asked for a group (or a position in a group) it is not a member of."""


_PLAN: Plan | None = None
_RANK: int = -1
_ROLE_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_SEQUENCE_GROUPS: dict[str, dist.ProcessGroup | None] = {}  # role -> this rank's block's group (None: not a member)
_WEIGHT_SYNC_GROUP: dist.ProcessGroup | None = None
_WEIGHT_SYNC_RANKS: tuple[int, ...] = ()
_MESSAGE_RANKS: dict[str, tuple[int, ...]] = {}
_MESSAGE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
_HELD: list[tuple[str, tuple[int, ...]]] = []


def _new_group(ranks, timeout, desc: str) -> dist.ProcessGroup | None:
    """Every rank calls this for every group; non-members get None instead of torch's sentinel."""
    group = dist.new_group(ranks=sorted(ranks), timeout=timeout, group_desc=desc)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def initialize(plan: Plan, message_groups: Mapping[str, Sequence[int]] | None = None,
               timeout_s: float | None = None) -> None:
    """Create and hold every group of `plan`, and one per rank set of `message_groups` (name -> ranks). Call on
    every rank, with the same arguments, once."""
    global _PLAN, _RANK, _ROLE_GROUPS, _SEQUENCE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _MESSAGE_RANKS, _MESSAGE_GROUPS, _HELD
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hpc_rlhf.dist.groups.initialize needs an initialised torch.distributed world "
                           "(hpc_rlhf.dist.bootstrap, or dist.init_process_group)")
    if _PLAN is not None:
        raise RuntimeError("process groups are already initialised; call groups.destroy() first")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlacementError(f"the plan is for {plan.world_size} ranks but the world has {world}\n"
                             f"{plan.format_table()}")
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    message_ranks = {name: tuple(sorted(set(ranks))) for name, ranks in (message_groups or {}).items()}
    for name, ranks in message_ranks.items():
        outside = [r for r in ranks if not 0 <= r < world]
        if outside:
            raise PlacementError(f"message group '{name}' names ranks {outside} outside the world of {world}")
    specs = group_layout.group_specs(plan, message_ranks)  # the same list `hpc-rlhf plan` counts from
    handles = [(spec, _new_group(spec.ranks, timeout, spec.desc)) for spec in specs]

    _PLAN, _RANK = plan, dist.get_rank()
    _ROLE_GROUPS = {spec.desc.removeprefix("role/"): group for spec, group in handles if spec.kind == "role"}
    _SEQUENCE_GROUPS = {spec.desc.split("/")[1]: group for spec, group in handles
                        if spec.kind == "sequence" and group is not None}
    _WEIGHT_SYNC_GROUP = next((group for spec, group in handles if spec.kind == "weight_sync"), None)
    _WEIGHT_SYNC_RANKS = group_layout.weight_sync_ranks(plan)
    _MESSAGE_RANKS = message_ranks
    _MESSAGE_GROUPS = {spec.ranks: group for spec, group in handles if spec.kind == "message"}
    _HELD = [(spec.desc, spec.ranks) for spec, group in handles if group is not None]


def is_initialized() -> bool:
    return _PLAN is not None


def destroy() -> None:
    """Destroy the groups this rank holds and forget the plan (a later `initialize` starts afresh)."""
    global _PLAN, _RANK, _ROLE_GROUPS, _SEQUENCE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _MESSAGE_RANKS, _MESSAGE_GROUPS, _HELD
    held = (list(_ROLE_GROUPS.values()) + list(_SEQUENCE_GROUPS.values()) + [_WEIGHT_SYNC_GROUP]
            + list(_MESSAGE_GROUPS.values()))
    if dist.is_initialized():
        for group in held:
            if group is not None:
                dist.destroy_process_group(group)
    _PLAN, _RANK = None, -1
    _ROLE_GROUPS, _SEQUENCE_GROUPS = {}, {}
    _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS = None, ()
    _MESSAGE_RANKS, _MESSAGE_GROUPS = {}, {}
    _HELD = []


def _state() -> Plan:
    if _PLAN is None:
        raise RuntimeError("process groups are not initialised: call hpc_rlhf.dist.groups.initialize(plan)")
    return _PLAN


def plan() -> Plan:
    return _state()


def world_group() -> dist.ProcessGroup:
    _state()
    return dist.group.WORLD


def role_ranks(name: str) -> tuple[int, ...]:
    """Global ranks of a role (public knowledge: any rank may ask)."""
    return _state().role(name).ranks


def role_leader(name: str) -> int:
    """Lowest global rank of a role: the one that logs, saves and sends weights for it."""
    return _state().role(name).leader


def has_role(name: str) -> bool:
    """Whether this rank holds role `name` (False when the plan has no such role)."""
    role_kind(name)  # a misspelt role name is an error, not a silent False
    plan_ = _state()
    return plan_.has(name) and _RANK in plan_.role(name).ranks


def my_roles() -> list[str]:
    return _state().roles_of_rank(_RANK)


def _not_member(what: str, ranks) -> NotInGroupError:
    mine = ", ".join(my_roles()) or "no role"
    return NotInGroupError(f"rank {_RANK} is not in {what} (ranks {format_ranks(ranks)}); it holds {mine}")


def role_group(name: str) -> dist.ProcessGroup:
    """The data-parallel group of model role `name`; only its members may ask."""
    ranks = role_ranks(name)
    if role_kind(name) == "rollout":
        raise PlacementError("rollout engines have no role group: nothing runs collectives among an engine's "
                             "ranks (see hpc_rlhf.dist.groups)")
    group = _ROLE_GROUPS[name]
    if group is None:
        raise _not_member(f"role '{name}'", ranks)
    return group


def rank_in_role(name: str) -> int:
    """This rank's index inside role `name` (its rank in the role group)."""
    ranks = role_ranks(name)
    if _RANK not in ranks:
        raise _not_member(f"role '{name}'", ranks)
    return ranks.index(_RANK)


def sequence_ranks(name: str) -> tuple[int, ...]:
    """The global ranks of this rank's sequence block in role `name` (they share one packed row), in role order;
    (this rank,) when the role is not sequence parallel. Only the role's ranks may ask."""
    ranks = role_ranks(name)
    if _RANK not in ranks:
        raise _not_member(f"role '{name}'", ranks)
    return next(block for block in _state().sequence_blocks(name) if _RANK in block)


def sequence_group(name: str) -> dist.ProcessGroup | None:
    """The group of this rank's sequence block in role `name` (`<kind>_sp` ranks sharing one packed row); None
    when the role is not sequence parallel (a block of one rank needs no group). Only the role's ranks may ask."""
    block = sequence_ranks(name)
    if len(block) == 1:
        return None
    return _SEQUENCE_GROUPS[name]


def rollout_engine_of_rank(rank: int | None = None) -> int:
    """Index of the rollout engine that global `rank` (default: this rank) belongs to."""
    plan_ = _state()
    rank = _RANK if rank is None else rank
    engines = plan_.role("rollout").engines
    for index, engine in enumerate(engines):
        if rank in engine:
            return index
    raise NotInGroupError(f"rank {rank} is not a rollout rank (rollout ranks "
                          f"{format_ranks(plan_.role('rollout').ranks)})")


def weight_sync_ranks() -> tuple[int, ...]:
    """Actor leader plus all rollout ranks, sorted (public knowledge)."""
    plan_ = _state()
    if not plan_.has("rollout"):
        raise PlacementError("this plan has no rollout role, so no weight-sync group")
    return _WEIGHT_SYNC_RANKS


def weight_sync_group() -> dist.ProcessGroup:
    ranks = weight_sync_ranks()
    if _WEIGHT_SYNC_GROUP is None:
        raise _not_member("the weight-sync group", ranks)
    return _WEIGHT_SYNC_GROUP


def message_group(name: str) -> dist.ProcessGroup:
    """The group created for message group `name` (see `initialize`); only its ranks may ask."""
    _state()
    if name not in _MESSAGE_RANKS:
        raise KeyError(f"no message group '{name}'; groups: {', '.join(_MESSAGE_RANKS) or 'none'}")
    ranks = _MESSAGE_RANKS[name]
    group = _MESSAGE_GROUPS[ranks]
    if group is None:
        raise _not_member(f"message group '{name}'", ranks)
    return group


def held_groups() -> list[tuple[str, tuple[int, ...]]]:
    """(description, ranks) of every group this rank belongs to (WORLD aside), in creation order: what it holds a
    communicator for on a GPU cluster (hpc_rlhf.dist.group_layout.held_by computes the same without torch)."""
    _state()
    return list(_HELD)
