"""The process groups of a placement, created once and held here (the only module that creates groups).

`initialize(plan)` must be called by every rank of an initialised torch.distributed world, with the same
plan (a pure function of the placement, so every rank has it). It creates, in this order on every rank,
because `new_group` must be entered by every rank of the world in the same order or the next one hangs:

1. one group per role, in plan order (actor, critic, ref, reward, reward2, ..., rollout). Colocated roles
   (`actor+ref`) get separate groups over the same ranks, so their collectives never mix;
2. one tensor-parallel group per rollout engine, in engine order;
3. the weight-sync group: the actor leader plus every rollout rank. The leader gathers the trained weights
   and broadcasts them over it. With the hybrid engine (`rollout@actor`) the rollout ranks are the actor's
   own ranks, so the group has the same members as the actor group (a separate handle): the leader
   broadcasts to the engines living beside the other actor ranks;
4. one single-rank group per global rank, in rank order (`self_group()`): DeepSpeed's model-parallel
   group for a role without model parallelism, which must be a real group, never None (None means WORLD).

A collective on a group this rank is not in silently returns None in torch, so asking for such a group here
raises `NotInGroupError` instead of handing out a handle that would do nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from hpc_rlhf.dist.placement import Plan, PlacementError, format_ranks, role_kind


class NotInGroupError(RuntimeError):
    """This rank asked for a group (or a position in a group) it is not a member of."""


_PLAN: Plan | None = None
_RANK: int = -1
_ROLE_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_ENGINE_GROUPS: list[dist.ProcessGroup | None] = []
_WEIGHT_SYNC_GROUP: dist.ProcessGroup | None = None
_WEIGHT_SYNC_RANKS: tuple[int, ...] = ()
_SELF_GROUP: dist.ProcessGroup | None = None


def _new_group(ranks, timeout) -> dist.ProcessGroup | None:
    """Every rank calls this for every group; non-members get None instead of torch's sentinel."""
    group = dist.new_group(ranks=sorted(ranks), timeout=timeout)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def initialize(plan: Plan, timeout_s: float | None = None) -> None:
    """Create and hold every group of `plan`. Call on every rank, with the same plan, once."""
    global _PLAN, _RANK, _ROLE_GROUPS, _ENGINE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _SELF_GROUP
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
    role_groups = {name: _new_group(role.ranks, timeout) for name, role in plan.roles.items()}
    engine_groups: list[dist.ProcessGroup | None] = []
    sync_group, sync_ranks = None, ()
    if plan.has("rollout"):
        engine_groups = [_new_group(engine, timeout) for engine in plan.role("rollout").engines]
        sync_ranks = tuple(sorted({plan.role("actor").leader} | set(plan.role("rollout").ranks)))
        sync_group = _new_group(sync_ranks, timeout)
    self_groups = [_new_group([rank], timeout) for rank in range(world)]

    _PLAN, _RANK = plan, dist.get_rank()
    _ROLE_GROUPS, _ENGINE_GROUPS = role_groups, engine_groups
    _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS = sync_group, sync_ranks
    _SELF_GROUP = self_groups[_RANK]


def is_initialized() -> bool:
    return _PLAN is not None


def destroy() -> None:
    """Destroy the groups this rank holds and forget the plan (a later `initialize` starts afresh)."""
    global _PLAN, _RANK, _ROLE_GROUPS, _ENGINE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _SELF_GROUP
    held = list(_ROLE_GROUPS.values()) + _ENGINE_GROUPS + [_WEIGHT_SYNC_GROUP, _SELF_GROUP]
    if dist.is_initialized():
        for group in held:
            if group is not None:
                dist.destroy_process_group(group)
    _PLAN, _RANK = None, -1
    _ROLE_GROUPS, _ENGINE_GROUPS = {}, []
    _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _SELF_GROUP = None, (), None


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
    """The data-parallel group of role `name`; only its members may ask."""
    ranks = role_ranks(name)
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


def rollout_tp_group(engine_index: int | None = None) -> dist.ProcessGroup:
    """The tensor-parallel group of a rollout engine (default: this rank's engine); members only."""
    engines = _state().role("rollout").engines
    index = rollout_engine_of_rank() if engine_index is None else engine_index
    if not 0 <= index < len(engines):
        raise IndexError(f"rollout engine {index} does not exist; there are {len(engines)}")
    group = _ENGINE_GROUPS[index]
    if group is None:
        raise _not_member(f"rollout engine {index}", engines[index])
    return group


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


def self_group() -> dist.ProcessGroup:
    """A group holding only this rank (DeepSpeed's model-parallel group for a role without model parallelism)."""
    _state()
    return _SELF_GROUP
