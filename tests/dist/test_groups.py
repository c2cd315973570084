"""Process groups of a placement on 6 gloo ranks (torchrun); the worker code is at the bottom of this file."""

import pytest

from hpc_rlhf.dist import groups
from hpc_rlhf.dist.placement import make_plan
from tests.distributed import run_ranks

# 6 ranks as 2 nodes of 3: actor+ref 0-1, reward 2, critic 3, rollout 4-5 (one engine of 2).
COLOCATED = ("actor+ref=2,critic=1,reward=1,rollout=2,rollout_tp=2", 6, 3)
# Hybrid: rollout engines [0,1] and [2,3] on the actor's ranks; critic 4-5.
HYBRID = ("actor=4,critic=2,rollout@actor,rollout_tp=2", 6, 6)


def test_plans_used_by_the_distributed_case():
    colocated = make_plan(*COLOCATED)
    assert {n: p.ranks for n, p in colocated.roles.items()} == {
        "actor": (0, 1), "critic": (3,), "ref": (0, 1), "reward": (2,), "rollout": (4, 5)}
    hybrid = make_plan(*HYBRID)
    assert hybrid.role("rollout").engines == ((0, 1), (2, 3))


def test_routes_go_to_the_ranks_that_consume_them():
    """Responses (with their log-probs) to every scoring rank, scores to the trained roles (rank 0 logs), evaluation
    responses to rank 0 alone; pure, so every rank computes the same."""
    routes = {key: (r.src, r.ranks) for key, r in groups.routes_of(make_plan(*COLOCATED)).items()}
    assert routes == {
        "responses/0": (4, (0, 1, 2, 3, 4)), "eval/0": (4, (0, 4)),
        "scores/actor": (0, (0, 1, 3)), "scores/critic": (3, (0, 1, 3)), "scores/ref": (0, (0, 1, 3)),
        "scores/reward": (2, (0, 1, 2, 3)), "scores/rules": (2, (0, 1, 2, 3))}
    grpo = groups.routes_of(make_plan("actor=1,ref=1,rollout=2", 4, 4))
    assert grpo["responses/1"].ranks == (0, 1, 3)
    assert grpo["scores/actor"].ranks == (0,) and grpo["scores/rules"].src == 0  # no reward model: the actor
    hybrid = groups.routes_of(make_plan("actor+ref=1,rollout@actor", 1, 1))
    assert {r.ranks for r in hybrid.values()} == {(0,)}  # one rank: nothing travels


def test_queries_before_initialize_fail_clearly():
    assert not groups.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised: call hpc_rlhf.dist.groups.initialize"):
        groups.role_group("actor")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed world"):
        groups.initialize(make_plan(*HYBRID))


def test_groups_on_six_ranks():
    proc = run_ranks(6, __file__, "groups", timeout=150)
    assert proc.stdout.count("groups ok") == 6, proc.stdout


if __name__ == "__main__":
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hpc_rlhf.dist.groups import NotInGroupError
    from hpc_rlhf.dist.placement import PlacementError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert sys.argv[1] == "groups" and world == 6

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
    groups.initialize(plan, timeout_s=60)
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

    # Route groups: the engine's responses reach the scoring ranks 0-4 and not rank 5; routes with the same
    # ranks share one group; a two-rank route has none (it goes point to point).
    if rank <= 4:
        got = torch.tensor([7.0 if rank == 4 else 0.0])
        dist.broadcast(got, src=4, group=groups.route_group("responses/0"))
        assert got.item() == 7.0
    else:
        assert "route 'responses/0'" in raises(NotInGroupError, groups.route_group, "responses/0")
    if rank in (0, 1, 3):
        assert groups.route_group("scores/actor") is groups.route_group("scores/critic")
    assert "point to point" in raises(PlacementError, groups.route_group, "eval/0")

    # Both ways a message travels: each consumer directly from its sender (small messages on gloo), and the route
    # group's broadcast (large ones; DIRECT_MAX_BYTES = 0 sends everything that way).
    from hpc_rlhf.trainers import rl_exchange
    from hpc_rlhf.trainers.rl_exchange import share_known, share_responses

    real_broadcast, broadcasts = dist.broadcast, []

    def counted_broadcast(*args, **kwargs):
        broadcasts.append(args)
        return real_broadcast(*args, **kwargs)

    dist.broadcast = counted_broadcast
    for direct_max in (rl_exchange.DIRECT_MAX_BYTES, 0):
        rl_exchange.DIRECT_MAX_BYTES = direct_max
        broadcasts.clear()
        # A step's scores in one round (share_known): per-token results of actor and ref from rank 0 (one message:
        # same sender, same ranks), the critic's from rank 3, reward and rule scores from rank 2, each on exactly
        # the ranks of its route. Every rank rebuilds what each sender sends from a seed.
        lengths = {"scores/actor": [3, 0, 2], "scores/critic": [3, 0, 2], "scores/ref": [3, 0, 2],
                   "scores/reward": [1, 1, 1], "scores/rules": [1, 1, 1]}

        def sent(key):
            g = torch.Generator().manual_seed(len(key) * 31 + sum(map(ord, key)))
            return [torch.randn(n, generator=g) for n in lengths[key]]

        routes = {key: groups.route(key) for key in lengths}
        messages = {key: (sent(key) if rank == routes[key].src else None, lengths[key] if rank in routes[key].ranks
                          else None) for key in lengths}
        got = share_known(messages)
        for key, route in routes.items():
            if rank in route.ranks:
                assert [torch.equal(a, b) for a, b in zip(got[key], sent(key))] == [True] * 3, (key, got[key])
            else:
                assert got[key] is None, (key, rank)

        # A batch's responses with their sampling log-probs (share_responses), from engine 0's first rank (4) to
        # the scoring ranks 0-3, bit for bit, token ids above 2^16 included; not to rank 5.
        g = torch.Generator().manual_seed(5)
        want = [torch.randint(0, 2**31 - 1, (n,), generator=g) for n in (4, 0, 7, 1)]
        want_logps = [-torch.rand(len(t), generator=g) * 9 for t in want]
        got, got_logps = share_responses(want if rank == 4 else None, want_logps if rank == 4 else None, "responses",
                                         counts=[4], max_len=7, with_logprobs=True)
        if rank <= 4:
            assert all(torch.equal(a, b) for a, b in zip(got[0], want)) and len(got[0]) == 4, got
            assert all(torch.equal(a, b) for a, b in zip(got_logps[0], want_logps)), got_logps
        else:
            assert got == [None] and got_logps == [None]
        # Direct: no broadcast at all. Broadcast: every rank on a route of three ranks or more (0-4) takes part.
        assert bool(broadcasts) == (not direct_max and rank <= 4), (direct_max, len(broadcasts))
    dist.broadcast = real_broadcast

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
    dist.destroy_process_group()
    print(f"rank {rank}: groups ok", flush=True)
