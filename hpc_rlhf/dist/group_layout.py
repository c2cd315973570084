"""The process groups of a placement as data: which groups hpc_rlhf.dist.groups creates, in which order, and
which of them a rank belongs to. Pure Python, no torch: `hpc-rlhf plan` counts a rank's groups from it on a login
node, and dist/groups.py creates exactly these groups in exactly this order (one code path for both).

The order (every rank of the world must enter `new_group` for every group, in the same order):
1. one group per model role, in plan order (`role/actor`, `role/critic`, ...); rollout engines get none;
2. one group per sequence block of every role with `<kind>_sp` > 1, roles in plan order, blocks in role order
   (`sequence/actor/0`, `sequence/actor/1`, ...): the K ranks that share one packed row (Plan.sequence_blocks);
3. the weight-sync group (`weight_sync`): the actor's leader plus every rollout rank;
4. one group per rank set of the message groups the caller names, in sorted order of their rank lists, named
   by the names that share it, comma-separated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hpc_rlhf.dist.placement import Plan


@dataclass(frozen=True)
class GroupSpec:
    desc: str  # the group's group_desc: `role/NAME`, `sequence/NAME/I`, `weight_sync`, or the names of the message
    # routes it carries
    ranks: tuple[int, ...]  # sorted
    kind: str  # "role", "sequence", "weight_sync" or "message"


def weight_sync_ranks(plan: Plan) -> tuple[int, ...]:
    """The actor's leader plus every rollout rank, sorted; () without a rollout role."""
    if not plan.has("rollout"):
        return ()
    return tuple(sorted({plan.role("actor").leader} | set(plan.role("rollout").ranks)))


def group_specs(plan: Plan, message_groups: Mapping[str, Sequence[int]] | None = None) -> list[GroupSpec]:
    """Every group of `plan` and of `message_groups` (name -> ranks), in creation order."""
    specs = [GroupSpec(f"role/{name}", role.ranks, "role") for name, role in plan.roles.items()
             if role.kind != "rollout"]
    specs += [GroupSpec(f"sequence/{name}/{index}", tuple(sorted(block)), "sequence")
              for name in plan.roles if plan.sequence_parallel(name) > 1
              for index, block in enumerate(plan.sequence_blocks(name))]
    if plan.has("rollout"):
        specs.append(GroupSpec("weight_sync", weight_sync_ranks(plan), "weight_sync"))
    names_of: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in (message_groups or {}).items():
        names_of.setdefault(tuple(sorted(set(ranks))), []).append(name)
    specs += [GroupSpec(",".join(names_of[ranks]), ranks, "message") for ranks in sorted(names_of)]
    return specs


def held_by(rank: int, specs: Sequence[GroupSpec]) -> list[GroupSpec]:
    """The groups of `specs` that `rank` belongs to, in creation order."""
    return [spec for spec in specs if rank in spec.ranks]
