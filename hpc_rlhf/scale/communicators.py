"""The NCCL communicators each rank of an RL placement holds, counted without torch, and what they cost in GPU
memory: what `hpc-rlhf plan` adds to its memory estimate. `hpc-rlhf simulate` finds the same by running the real
set-up (tests/scale/test_simulate.py checks that the two agree on every rank).

A rank holds a communicator for (torch's NCCL backend creates them lazily, at a group's first use; every group
below is used every step):
- every process group it belongs to, WORLD aside: the groups hpc_rlhf.dist.groups creates, from the pure list of
  hpc_rlhf.dist.group_layout and the route table's message groups (hpc_rlhf.rl.routes); on the ranks of a role
  with `<kind>_sp` > 1 that includes its sequence block's group (one per rank and role, whatever the job's size:
  the bound of DESIGN §3, 7 per rank, 8 with ZeRO-0, becomes 8 and 9 there, tests/scale/test_simulate.py);
- every distinct rank it talks to point to point (torch sets up a communicator per pair): the routes of two ranks;
- DeepSpeed's model-parallel group of this rank alone (engines.deepspeed_compat.singleton_group), on the ranks of
  a trained role under ZeRO stage 0, where DeepSpeed's unsharded optimizers all-reduce gradient norms and overflow
  flags over it; ZeRO 1-3 skip a model-parallel group of one rank (deepspeed.comm.pg_utils.is_parallel), and the
  frozen roles' inference engines run no collective on it.

Memory: NCCL_COMMUNICATOR_GB per communicator. NCCL's buffers grow with its channels (one set per channel and
peer: 4 MiB for the simple protocol plus the LL and LL128 buffers): measured by a user on 4 A100s with NVLink at
544 MB for a 2-rank group and 688 MB for larger ones (NVIDIA/nccl#964), and NCCL's developers confirm that more
communicators mean more memory unless they are split with shared resources (NVIDIA/nccl#986). 0.6 GB is taken
here; a job that lowers NCCL_BUFFSIZE or its channels needs less.
"""

from __future__ import annotations

from hpc_rlhf.dist.group_layout import group_specs
from hpc_rlhf.dist.placement import Plan
from hpc_rlhf.rl import routes

NCCL_COMMUNICATOR_GB = 0.6
TRAINED_KINDS = ("actor", "critic")
SINGLETON = "deepspeed/model_parallel"


def message_groups_of(plan: Plan) -> dict[str, tuple[int, ...]]:
    """The message groups an RL job on `plan` creates; none for a placement without rollout engines (the
    one-model modes)."""
    return routes.message_groups(plan) if plan.has("rollout") else {}


def communicators_of(plan: Plan, zero_stage: int) -> list[list[str]]:
    """Per rank, the names of the communicators it holds (see the module docstring): group descriptions,
    `p2p/PEER`, and SINGLETON."""
    held: list[list[str]] = [[] for _ in range(plan.world_size)]
    for spec in group_specs(plan, message_groups_of(plan)):
        for rank in spec.ranks:
            held[rank].append(spec.desc)
    if plan.has("rollout"):
        peers: list[set[int]] = [set() for _ in range(plan.world_size)]
        for low, high in routes.point_to_point_pairs(plan):
            peers[low].add(high)
            peers[high].add(low)
        for rank, others in enumerate(peers):
            held[rank] += [f"p2p/{other}" for other in sorted(others)]
    if zero_stage == 0:
        for role in plan.roles.values():
            if role.kind in TRAINED_KINDS:
                for rank in role.ranks:
                    if SINGLETON not in held[rank]:
                        held[rank].append(SINGLETON)
    return held


def buffers_gb(plan: Plan, zero_stage: int) -> dict[str, float]:
    """GB of communicator buffers on each rank of a role: the most any of its ranks holds (what
    hpc_rlhf.dist.allocation.check_allocation adds to a role's memory, as `extra_gb_of`)."""
    held = communicators_of(plan, zero_stage)
    return {name: max(len(held[r]) for r in role.ranks) * NCCL_COMMUNICATOR_GB for name, role in plan.roles.items()}


def annotate(result: dict, plan: Plan, zero_stage: int) -> dict:
    """`hpc-rlhf plan`'s result with each role's communicator count (the most any of its ranks holds; their
    memory is in `memory_gb_per_rank` already: `buffers_gb`) and the job's `max_groups_per_rank`."""
    held = communicators_of(plan, zero_stage)
    for name, row in result["roles"].items():
        row["communicators"] = max(len(held[r]) for r in plan.role(name).ranks)
    result["max_groups_per_rank"] = max(len(h) for h in held)
    result["nccl_communicator_gb"] = NCCL_COMMUNICATOR_GB
    return result


def rank_memory_gb(result: dict, plan: Plan, rank: int, communicators: int) -> float:
    """The planner's memory figure for one rank holding `communicators`: its roles' own GB (colocated roles add
    up), the overhead, and its communicators' buffers."""
    name = plan.roles_of_rank(rank)
    if not name:
        return 0.0
    row = result["roles"][name[0]]
    without = row["memory_gb_per_rank"] - row["breakdown_gb"].get("nccl", 0.0)
    return round(without + communicators * NCCL_COMMUNICATOR_GB, 3)
