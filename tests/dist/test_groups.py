"""Process groups of a placement on 6 gloo ranks (torchrun); the worker code is at the bottom of this file."""

import pytest

from hpc_rlhf.dist import groups
from hpc_rlhf.dist.placement import make_plan
from tests.distributed import run_ranks, run_worker

# 6 ranks as 2 nodes of 3: actor+ref 0-1, reward 2, critic 3, rollout 4-5 (one engine of 2).
COLOCATED = ("actor+ref=2,critic=1,reward=1,rollout=2,rollout_tp=2", 6, 3)
# Hybrid: rollout engines [0,1] and [2,3] on the actor's ranks; critic 4-5.
HYBRID = ("actor=4,critic=2,rollout@actor,rollout_tp=2", 6, 6)
# Sequence parallel: the actor's blocks [0,1] and [2,3] each share a row; critic 4-5 is not sequence parallel.
SEQUENCE = ("actor=4,critic=2,actor_sp=2", 6, 6)


def test_plans_used_by_the_distributed_case():
    colocated = make_plan(*COLOCATED)
    assert {n: p.ranks for n, p in colocated.roles.items()} == {
        "actor": (0, 1), "critic": (3,), "ref": (0, 1), "reward": (2,), "rollout": (4, 5)}
    hybrid = make_plan(*HYBRID)
    assert hybrid.role("rollout").engines == ((0, 1), (2, 3))


def test_queries_before_initialize_fail_clearly():
    assert not groups.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised: call hpc_rlhf.dist.groups.initialize"):
        groups.role_group("actor")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed world"):
        groups.initialize(make_plan(*HYBRID))


def test_groups_on_six_ranks():
    proc = run_ranks(6, __file__, "groups", timeout=150)
    assert proc.stdout.count("groups ok") == 6, proc.stdout


def _groups_worker():
    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist.groups import NotInGroupError
    from hpc_rlhf.dist.placement import PlacementError

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 6

    def raises(error, call, *args):
        try:
            call(*args)
        except error as exc:
            return str(exc)
        raise AssertionError(f"rank {rank}: {call.__name__}{args} did not raise {error.__name__}")

    # A plan for another world size is refused before any group is created (so no rank is left waiting).
    assert "plan is for 8 ranks" in raises(PlacementError, groups.initialize, make_plan("actor=8", 8, 8))

    # ------------------------------------------------------------------ colocated layout, 2 nodes of 3
    plan = make_plan(*COLOCATED)
    # Message groups are named rank sets; names with the same ranks share one group, a rank outside the world is
    # refused before any group exists.
    message_groups = {"wide": (0, 1, 2, 3, 4), "pair": (0, 3), "pair-again": (3, 0), "three": (0, 1, 3)}
    assert "names ranks [6]" in raises(PlacementError, groups.initialize, plan, {"bad": (0, 6)})
    groups.initialize(plan, message_groups, timeout_s=60)
    assert groups.is_initialized() and groups.plan() is plan
    assert "already initialised" in raises(RuntimeError, groups.initialize, plan)
    expected_roles = {0: ["actor", "ref"], 1: ["actor", "ref"], 2: ["reward"], 3: ["critic"],
                      4: ["rollout"], 5: ["rollout"]}[rank]
    assert groups.my_roles() == expected_roles
    for name, role in plan.roles.items():
        assert groups.role_ranks(name) == role.ranks and groups.role_leader(name) == min(role.ranks)
        if name == "rollout":
            assert groups.has_role(name) == (name in expected_roles)
        elif name in expected_roles:
            group = groups.role_group(name)
            assert dist.get_process_group_ranks(group) == list(role.ranks)
            assert groups.has_role(name) and groups.rank_in_role(name) == role.ranks.index(rank)
        else:
            assert not groups.has_role(name)
            message = raises(NotInGroupError, groups.role_group, name)
            assert f"rank {rank} is not in role '{name}'" in message
            raises(NotInGroupError, groups.rank_in_role, name)
    if rank < 2:  # colocated roles: same ranks, separate handles
        assert groups.role_group("actor") is not groups.role_group("ref")
    assert not groups.has_role("reward2")
    raises(PlacementError, groups.has_role, "critc")
    raises(PlacementError, groups.role_ranks, "reward2")
    assert "no role group" in raises(PlacementError, groups.role_group, "rollout")
    assert groups.world_group() is dist.group.WORLD

    # An all_reduce on a role group moves data only between its ranks: one tensor per model role on every rank;
    # members reduce theirs, then the world compares every rank's tensors.
    models = [name for name in plan.roles if name != "rollout"]
    values = torch.tensor([float(rank + 1)] * len(models))
    for index, name in enumerate(models):
        if groups.has_role(name):
            part = values[index:index + 1].clone()
            dist.all_reduce(part, group=groups.role_group(name))
            values[index] = part[0]
    gathered = [torch.zeros_like(values) for _ in range(world)]
    dist.all_gather(gathered, values)
    for other in range(world):
        for index, name in enumerate(models):
            role = plan.role(name)
            want = sum(r + 1 for r in role.ranks) if other in role.ranks else other + 1
            assert gathered[other][index].item() == want, (other, name, gathered[other])

    # Weight sync: actor leader + rollout ranks.
    assert groups.weight_sync_ranks() == (0, 4, 5)
    if rank in (0, 4, 5):
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=groups.weight_sync_group())
        assert total.item() == 9
        if rank != 0:
            assert groups.rollout_engine_of_rank() == 0
    else:
        raises(NotInGroupError, groups.weight_sync_group)
        raises(NotInGroupError, groups.rollout_engine_of_rank)

    # Message groups: a broadcast over "wide" reaches ranks 0-4 and not rank 5; names with the same ranks share a
    # group; every group this rank holds is listed with its description (what simulate counts).
    if rank <= 4:
        got = torch.tensor([7.0 if rank == 4 else 0.0])
        dist.broadcast(got, src=4, group=groups.message_group("wide"))
        assert got.item() == 7.0
    else:
        assert "message group 'wide'" in raises(NotInGroupError, groups.message_group, "wide")
    if rank in (0, 3):
        assert groups.message_group("pair") is groups.message_group("pair-again")
    assert "no message group 'nope'" in raises(KeyError, groups.message_group, "nope")
    held = dict(groups.held_groups())
    expected_held = {"role/actor", "role/ref"} if rank < 2 else {"role/reward"} if rank == 2 else \
        {"role/critic"} if rank == 3 else set()
    expected_held |= {"weight_sync"} if rank in (0, 4, 5) else set()
    expected_held |= {"wide"} if rank <= 4 else set()
    expected_held |= {"pair,pair-again"} if rank in (0, 3) else set()
    expected_held |= {"three"} if rank in (0, 1, 3) else set()
    assert set(held) == expected_held, (rank, held)

    # Different collectives at the same time on different groups must not pair up across groups:
    # actor all_reduces 50 times while the reward rank all_gathers alone;
    # then ref (same ranks as actor, its own handle) all_gathers 20 times.
    if groups.has_role("actor"):
        for step in range(50):
            x = torch.tensor([float(step * 10 + rank)])
            dist.all_reduce(x, group=groups.role_group("actor"))
            assert x.item() == step * 20 + 1, (step, x)
        for step in range(20):
            parts = [torch.zeros(2) for _ in range(2)]
            dist.all_gather(parts, torch.tensor([float(rank), float(step)]), group=groups.role_group("ref"))
            assert [p.tolist() for p in parts] == [[0.0, step], [1.0, step]]
    elif groups.has_role("reward"):
        for step in range(40):
            parts = [torch.zeros(1)]
            dist.all_gather(parts, torch.tensor([float(step)]), group=groups.role_group("reward"))
            assert parts[0].item() == step
    dist.barrier()

    groups.destroy()
    assert not groups.is_initialized()

    # ------------------------------------------------------------------ hybrid layout: rollout@actor
    plan = make_plan(*HYBRID)
    groups.initialize(plan, timeout_s=60)
    assert groups.weight_sync_ranks() == plan.role("actor").ranks == (0, 1, 2, 3)
    if rank < 4:
        assert groups.my_roles() == ["actor", "rollout"]
        engine = groups.rollout_engine_of_rank()
        assert engine == rank // 2 and groups.rank_in_role("rollout") == rank
        assert groups.weight_sync_group() is not groups.role_group("actor")
        z = torch.tensor([42.0 if rank == 0 else 0.0])
        dist.broadcast(z, src=0, group=groups.weight_sync_group())
        assert z.item() == 42.0
    else:
        assert groups.my_roles() == ["critic"]
        raises(NotInGroupError, groups.rollout_engine_of_rank)
        raises(NotInGroupError, groups.weight_sync_group)
        w = torch.tensor([float(rank)])
        dist.all_reduce(w, group=groups.role_group("critic"))
        assert w.item() == 9
    dist.barrier()
    groups.destroy()

    # ------------------------------------------------------------------ sequence parallel: actor_sp=2
    plan = make_plan(*SEQUENCE)
    groups.initialize(plan, timeout_s=60)
    if rank < 4:
        block = (0, 1) if rank < 2 else (2, 3)
        assert groups.sequence_ranks("actor") == block
        group = groups.sequence_group("actor")
        assert dist.get_process_group_ranks(group) == list(block)
        s = torch.tensor([float(rank + 1)])
        dist.all_reduce(s, group=group)  # only the block's two ranks add up
        assert s.item() == sum(r + 1 for r in block)
        assert "sequence/actor/" + str(rank // 2) in dict(groups.held_groups())
        assert "rank" in raises(NotInGroupError, groups.sequence_group, "critic")
        raises(NotInGroupError, groups.sequence_ranks, "critic")
    else:
        assert groups.sequence_ranks("critic") == (rank,) and groups.sequence_group("critic") is None
        assert f"rank {rank} is not in role 'actor'" in raises(NotInGroupError, groups.sequence_group, "actor")
        assert not [d for d in dict(groups.held_groups()) if d.startswith("sequence/")]
    dist.barrier()
    groups.destroy()
    print(f"rank {rank}: groups ok", flush=True)


if __name__ == "__main__":
    run_worker({"groups": _groups_worker}, timeout_s=60)
