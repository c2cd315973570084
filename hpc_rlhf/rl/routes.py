"""The RL step's route table: which message goes from whom to whom, a pure function of the placement. No torch
(`hpc-rlhf plan` counts a rank's communicators from it on a login node); the calls that move the messages are
messages.py's, the transport hpc_rlhf.dist.exchange's.

Rank 0, the actor's leader, logs the step's figures. The routes:
- `engines` (a gather): a batch's responses and their sampling log-probs, or an evaluation's greedy responses,
  from each rollout engine's first rank to the hub (the first engine's first rank), over one group of the
  engines' first ranks;
- `responses`: the whole batch, from the hub to every scoring rank (actor, critic, ref, teacher, reward models;
  the rule rewards run on one of them) and rank 0. The log-probs are for the trained roles; they ride in the same
  message (messages.share_responses says why);
- `eval`: an evaluation's greedy responses, from the hub to rank 0 only (the one rank that decodes them);
- `scores/ROLE` (actor, critic, ref, teacher, reward, reward2, ..., and `rules` for the rule/remote rewards): that
  role's per-sample results, from its leader (the rule rewards' rank for `rules`) to the trained roles and rank 0;
  the roles whose leaders are not trained ranks send over one group of the trained ranks and all those leaders
  (each of them gets the others' scores too), so that a teacher or a second reward model on ranks of its own adds
  no group on the trained ranks;
- `figures/critic` (a gather): the critic's training figures, to rank 0, which logs them, over the trained
  ranks (only the critic's leader has figures; the others take part in the gather with nothing to say).

Why this shape. On a GPU cluster every group a rank belongs to is an NCCL communicator on that rank (buffers, a
world-wide `new_group` call, an initialisation at first use), and so is every distinct peer it sends to or
receives from point to point. One route per engine (what this table had before) put every scoring rank in one
group per engine: 515 communicators on a scoring rank of a 1,024-GPU job. Here the engines meet in one group
and their messages reach the scoring ranks as one batch from the hub, so what a rank holds is its roles' groups,
the weight-sync group and at most a handful of these, whatever the number of engines (`hpc-rlhf simulate`
checks it on the real set-up of 1,024 ranks). Every message goes only to the ranks that consume it, but for the
scores of the untrained scoring roles, which also reach each other's leaders (one group for all of them); the hub
relays the batch (one more hop, a few megabytes at most per step).

A job's table is a `Routes`: the RL recipe builds it once from its plan and reference mode and hands it to every
message call (messages.py) and to hpc_rlhf.dist.groups (the rank sets that need a group), so no module holds a
table that a call order must set.

How a message travels (groups of three ranks or more; a route of two ranks is point to point):
`messages._post` and `exchange.post`; on gloo a small message keeps going point to point from each engine to
each consumer (`exchange.goes_direct`): where ranks share CPU cores the latency of a hop costs more than bytes,
and gloo holds no per-pair communicator.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hpc_rlhf.dist.placement import Plan, role_kind

LOGGING_RANK = 0  # the actor's leader (placement puts the actor first), which logs the step's figures
ENGINES = "engines"


@dataclass(frozen=True)
class Route:
    """One sender (`src`) to its consumers: `ranks` holds the sender and its consumers, sorted. `keeps`: the sender
    consumes the message too (a hub that scores, rank 0 sending to itself), though nothing travels to it."""
    key: str
    src: int
    ranks: tuple[int, ...]
    keeps: bool = False

    @functools.cached_property
    def consumers(self) -> tuple[int, ...]:
        """The ranks the message travels to."""
        return tuple(r for r in self.ranks if r != self.src)

    @functools.cached_property
    def takers(self) -> tuple[int, ...]:
        """Every rank that consumes the message: its consumers, and its sender when it `keeps` it."""
        return self.ranks if self.keeps else self.consumers


@dataclass(frozen=True)
class Gather:
    """Every rank of `ranks` (sorted, `dst` among them) to `dst`, one message each, of a size every rank knows."""
    key: str
    dst: int
    ranks: tuple[int, ...]

    @functools.cached_property
    def senders(self) -> tuple[int, ...]:
        return tuple(r for r in self.ranks if r != self.dst)


def rule_reward_rank(plan: Plan) -> int:
    """Where the rule and remote rewards run: the first reward model's leader, else the actor's leader."""
    rewards = [name for name in plan.roles if role_kind(name) == "reward"]
    return plan.role(rewards[0] if rewards else "actor").leader


def engine_leaders(plan: Plan) -> tuple[int, ...]:
    """Each rollout engine's first rank, in engine order (ascending: engines take consecutive ranks)."""
    return tuple(engine[0] for engine in plan.role("rollout").engines) if plan.has("rollout") else ()


def routes_of(plan: Plan, ref_role: str = "ref") -> dict[str, Route | Gather]:
    """Every route of `plan` (see the module docstring). Pure: every rank computes the same. `ref_role`: the role
    whose leader sends `scores/ref` when it is not a `ref` role (a LoRA actor's own ranks compute the reference
    with the adapter off: `ref_mode=adapter_disabled`)."""
    def ranks_of(kinds) -> set[int]:
        return {r for role in plan.roles.values() if role.kind in kinds for r in role.ranks}

    trained = ranks_of(("actor", "critic")) | {LOGGING_RANK}
    scorers = ranks_of(("actor", "critic", "ref", "teacher", "reward")) | {LOGGING_RANK}
    routes: dict[str, Route | Gather] = {}

    def add(key: str, src: int, consumers: set[int]) -> None:
        routes[key] = Route(key, src, tuple(sorted(consumers | {src})), keeps=src in consumers)

    leaders = engine_leaders(plan)
    if leaders:
        hub = leaders[0]
        routes[ENGINES] = Gather(ENGINES, hub, leaders)
        add("responses", hub, scorers)
        add("eval", hub, {LOGGING_RANK})
    senders = {f"scores/{name}": role.leader for name, role in plan.roles.items() if role.kind != "rollout"}
    if ref_role != "ref":
        senders["scores/ref"] = plan.role(ref_role).leader
    senders["scores/rules"] = rule_reward_rank(plan)
    # The senders outside the trained ranks (ref, teacher, reward models) share one group with them: each more
    # such role would otherwise add a group on every trained rank. Each of these senders also receives the others'
    # scores, which it does not use (a few megabytes a step at most).
    outside = {src for src in senders.values() if src not in trained}
    for key, src in senders.items():
        add(key, src, trained if src in trained else trained | outside)
    if plan.has("critic"):
        routes["figures/critic"] = Gather("figures/critic", LOGGING_RANK, tuple(sorted(trained)))
    return routes


def travels_over_a_group(route: Route | Gather) -> bool:
    """Routes of three ranks or more travel over a group of their own; two ranks talk point to point, one rank
    sends nothing."""
    return len(route.ranks) > 2


def message_groups(plan: Plan, ref_role: str = "ref") -> dict[str, tuple[int, ...]]:
    """The rank sets that need a group (`travels_over_a_group`): what hpc_rlhf.dist.groups.initialize creates,
    named by route (routes with the same ranks share one group)."""
    return Routes(plan, ref_role).message_groups()


class Routes:
    """The route table of one job: `plan`'s routes with `ref_role`'s leader sending `scores/ref` (see `routes_of`).
    Built once by the RL recipe and passed to every message call; immutable, the same on every rank."""

    def __init__(self, plan: Plan, ref_role: str = "ref"):
        if ref_role != "ref" and not plan.has(ref_role):
            raise ValueError(f"the reference comes from role '{ref_role}', which this placement does not have")
        self.plan = plan
        self.ref_role = ref_role
        self._table = routes_of(plan, ref_role)

    def __getitem__(self, key: str) -> Route | Gather:
        if key not in self._table:
            raise KeyError(f"no route '{key}' in this placement; routes: {', '.join(self._table)}")
        return self._table[key]

    def __contains__(self, key: str) -> bool:
        return key in self._table

    def keys(self):
        return self._table.keys()

    def message_groups(self) -> dict[str, tuple[int, ...]]:
        """The rank sets hpc_rlhf.dist.groups.initialize creates a group for (`message_groups`)."""
        return {key: r.ranks for key, r in self._table.items() if travels_over_a_group(r)}

    @property
    def rule_reward_rank(self) -> int:
        return rule_reward_rank(self.plan)

    def __repr__(self) -> str:
        return f"Routes({', '.join(self.plan.roles)} on {self.plan.world_size} ranks, ref_role={self.ref_role!r})"


def point_to_point_pairs(plan: Plan) -> set[tuple[int, int]]:
    """(lower, higher) rank pairs that talk point to point on NCCL: the routes of two ranks. (On gloo small
    messages of larger routes go point to point too; gloo holds no communicator per pair.)"""
    return {tuple(r.ranks) for r in routes_of(plan).values() if len(r.ranks) == 2}
