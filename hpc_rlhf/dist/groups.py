"""The process groups of a placement, created once and held here (the only module that creates groups).

`initialize(plan)` must be called by every rank of an initialised torch.distributed world, with the same
plan (a pure function of the placement, so every rank has it). It creates, in this order on every rank,
because `new_group` must be entered by every rank of the world in the same order or the next one hangs:

1. one group per model role, in plan order (actor, critic, ref, reward, reward2, ...): the data-parallel group
   DeepSpeed uses for that role. Colocated roles (`actor+ref`) get separate groups over the same ranks, so
   their collectives never mix. Rollout engines get none: nothing runs collectives among an engine's ranks
   (a vLLM engine of several GPUs is driven by its first rank through vLLM's own processes);
2. the weight-sync group: the actor leader plus every rollout rank. The leader gathers the trained weights
   and broadcasts them over it. With the hybrid engine (`rollout@actor`) the rollout ranks are the actor's
   own ranks, so the group has the same members as the actor group (a separate handle);
3. one group per set of ranks that an experience message goes to (`route`), for sets of three ranks or more,
   in sorted order of their rank lists; a set with the same ranks as another shares its group. Messages to
   one other rank go point to point, and a message whose only consumer is its sender does not travel.

Routes (DESIGN §4.3: to the ranks that need them). Rank 0, the actor's leader, logs the step's figures:
- `responses/E`: engine E's responses and their sampling log-probs, from its first rank to every scoring rank
  (actor, critic, ref, reward models; the rule rewards run on one of them) and rank 0. The log-probs are for the
  trained roles; they ride in the same message (trainers/rl_exchange.py says why);
- `scores/ROLE` (actor, critic, ref, reward, reward2, ..., and `rules` for the rule/remote rewards): that
  role's per-sample results, from its leader (the rule rewards' rank for `rules`) to the trained roles and
  rank 0;
- `eval/E`: engine E's greedy responses of an evaluation, to rank 0 only (the one rank that decodes them).

DeepSpeed's model-parallel group (a single rank) is created by the rank alone, with local synchronization,
in `engines.deepspeed_compat.singleton_group`, so no per-rank groups are made here.

A collective on a group this rank is not in silently returns None in torch, so asking for such a group here
raises `NotInGroupError` instead of handing out a handle that would do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hpc_rlhf.dist.placement import Plan, PlacementError, format_ranks, role_kind

LOGGING_RANK = 0  # the actor's leader (placement puts the actor first), which logs the step's figures


class NotInGroupError(RuntimeError):
    """This rank asked for a group (or a position in a group) it is not a member of."""


@dataclass(frozen=True)
class Route:
    """Who sends one kind of experience message (`src`) and every rank that takes part (`ranks`: the sender and
    its consumers, sorted)."""
    key: str
    src: int
    ranks: tuple[int, ...]

    @property
    def consumers(self) -> tuple[int, ...]:
        return tuple(r for r in self.ranks if r != self.src)


_PLAN: Plan | None = None
_RANK: int = -1
_ROLE_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_WEIGHT_SYNC_GROUP: dist.ProcessGroup | None = None
_WEIGHT_SYNC_RANKS: tuple[int, ...] = ()
_ROUTES: dict[str, Route] = {}
_ROUTE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup | None] = {}


def _new_group(ranks, timeout) -> dist.ProcessGroup | None:
    """Every rank calls this for every group; non-members get None instead of torch's sentinel."""
    group = dist.new_group(ranks=sorted(ranks), timeout=timeout)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def rule_reward_rank(plan: Plan) -> int:
    """Where the rule and remote rewards run: the first reward model's leader, else the actor's leader."""
    rewards = [name for name in plan.roles if role_kind(name) == "reward"]
    return plan.role(rewards[0] if rewards else "actor").leader


def routes_of(plan: Plan) -> dict[str, Route]:
    """Every route of `plan` (see the module docstring). Pure: every rank computes the same."""
    def ranks_of(kinds) -> set[int]:
        return {r for name, role in plan.roles.items() if role.kind in kinds for r in role.ranks}

    trained = ranks_of(("actor", "critic")) | {LOGGING_RANK}
    scorers = ranks_of(("actor", "critic", "ref", "reward")) | {LOGGING_RANK}
    routes: dict[str, Route] = {}

    def add(key: str, src: int, consumers: set[int]) -> None:
        routes[key] = Route(key, src, tuple(sorted(consumers | {src})))

    if plan.has("rollout"):
        for index, engine in enumerate(plan.role("rollout").engines):
            add(f"responses/{index}", engine[0], scorers)
            add(f"eval/{index}", engine[0], {LOGGING_RANK})
    for name, role in plan.roles.items():
        if role.kind != "rollout":
            add(f"scores/{name}", role.leader, trained)
    add("scores/rules", rule_reward_rank(plan), trained)
    return routes


def initialize(plan: Plan, timeout_s: float | None = None) -> None:
    """Create and hold every group of `plan`. Call on every rank, with the same plan, once."""
    global _PLAN, _RANK, _ROLE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _ROUTES, _ROUTE_GROUPS
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
    role_groups = {name: _new_group(role.ranks, timeout) for name, role in plan.roles.items()
                   if role.kind != "rollout"}
    sync_group, sync_ranks = None, ()
    if plan.has("rollout"):
        sync_ranks = tuple(sorted({plan.role("actor").leader} | set(plan.role("rollout").ranks)))
        sync_group = _new_group(sync_ranks, timeout)
    routes = routes_of(plan)
    route_groups = {ranks: _new_group(ranks, timeout)
                    for ranks in sorted({route.ranks for route in routes.values() if len(route.ranks) > 2})}

    _PLAN, _RANK = plan, dist.get_rank()
    _ROLE_GROUPS = role_groups
    _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS = sync_group, sync_ranks
    _ROUTES, _ROUTE_GROUPS = routes, route_groups


def is_initialized() -> bool:
    return _PLAN is not None


def destroy() -> None:
    """Destroy the groups this rank holds and forget the plan (a later `initialize` starts afresh)."""
    global _PLAN, _RANK, _ROLE_GROUPS, _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS, _ROUTES, _ROUTE_GROUPS
    held = list(_ROLE_GROUPS.values()) + [_WEIGHT_SYNC_GROUP] + list(_ROUTE_GROUPS.values())
    if dist.is_initialized():
        for group in held:
            if group is not None:
                dist.destroy_process_group(group)
    _PLAN, _RANK = None, -1
    _ROLE_GROUPS = {}
    _WEIGHT_SYNC_GROUP, _WEIGHT_SYNC_RANKS = None, ()
    _ROUTES, _ROUTE_GROUPS = {}, {}


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


def route(key: str) -> Route:
    """The route of experience message `key` (public knowledge: any rank may ask)."""
    _state()
    if key not in _ROUTES:
        raise KeyError(f"no route '{key}' in this placement; routes: {', '.join(_ROUTES)}")
    return _ROUTES[key]


def route_group(key: str) -> dist.ProcessGroup:
    """The group that carries route `key` (routes of three ranks or more); only its ranks may ask."""
    path = route(key)
    if len(path.ranks) <= 2:
        raise PlacementError(f"route '{key}' (ranks {format_ranks(path.ranks)}) travels point to point or not "
                             "at all: it has no group")
    group = _ROUTE_GROUPS[path.ranks]
    if group is None:
        raise _not_member(f"the group of route '{key}'", path.ranks)
    return group
