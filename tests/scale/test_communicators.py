"""The NCCL communicators each rank of a placement holds (hpc_rlhf/scale/communicators.py), counted by hand on small
placements, and what `hpc-rlhf plan` adds to its figures from them."""

import pytest

from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.scale import communicators

# actor 0, critic 1, reward 2, two engines of one rank (3 and 4). By hand:
# - role groups of one rank each: role/actor (0), role/critic (1), role/reward (2);
# - weight_sync: the actor's leader and every rollout rank (0, 3, 4);
# - the hub is engine 0's rank 3; its batch goes to every scoring rank: `responses` over (0, 1, 2, 3);
# - reward and rule scores from rank 2 to the trained ranks 0-1: (0, 1, 2), one group for both routes;
# - two-rank routes go point to point: the engines' gather (3-4), eval (3 to 0), the actor's and critic's scores
#   and the critic's figures (0-1).
SEPARATE = ("actor=1,critic=1,reward=1,rollout=2", 5, 5)
SEPARATE_HELD = [
    ["role/actor", "weight_sync", "scores/reward,scores/rules", "responses", "p2p/1", "p2p/3"],
    ["role/critic", "scores/reward,scores/rules", "responses", "p2p/0"],
    ["role/reward", "scores/reward,scores/rules", "responses"],
    ["weight_sync", "responses", "p2p/0", "p2p/4"],
    ["weight_sync", "p2p/3"],
]


def test_a_small_placements_communicators_rank_by_rank():
    plan = make_plan(*SEPARATE)
    assert communicators.communicators_of(plan, zero_stage=3) == SEPARATE_HELD
    # ZeRO-0: the trained roles' ranks (actor 0, critic 1) also hold DeepSpeed's model-parallel group of one rank.
    assert communicators.communicators_of(plan, zero_stage=0) == [
        SEPARATE_HELD[0] + [communicators.SINGLETON], SEPARATE_HELD[1] + [communicators.SINGLETON],
        *SEPARATE_HELD[2:]]


def test_a_sequence_parallel_role_adds_its_blocks_group_on_its_ranks_only():
    """SEPARATE with two actor ranks sharing each row (actor=2,actor_sp=2): both actor ranks hold one more
    communicator, their block's `sequence/actor/0`, right after their role group; no other rank does."""
    plan = make_plan("actor=2,critic=1,reward=1,rollout=2,actor_sp=2", 6, 6)
    held = communicators.communicators_of(plan, zero_stage=3)
    plain = communicators.communicators_of(make_plan("actor=2,critic=1,reward=1,rollout=2", 6, 6), zero_stage=3)
    for rank in (0, 1):
        assert held[rank][:2] == ["role/actor", "sequence/actor/0"]
        assert sorted(held[rank]) == sorted(plain[rank] + ["sequence/actor/0"])
    assert held[2:] == plain[2:]


def test_routes_with_the_same_ranks_share_one_communicator():
    """Hybrid on 3 ranks: actor+ref 0-1 (also the engines), critic 2. The batch, every role's scores and the
    critic's figures all go over ranks 0-2: one group. The engines' gather is 0-1, point to point; the evaluation
    stays on rank 0. A rank holding two roles holds the singleton group once."""
    plan = make_plan("actor+ref=2,critic=1,rollout@actor", 3, 3)
    shared = "responses,scores/actor,scores/critic,scores/ref,scores/rules,figures/critic"
    single = communicators.SINGLETON
    assert communicators.communicators_of(plan, zero_stage=0) == [
        ["role/actor", "role/ref", "weight_sync", shared, "p2p/1", single],
        ["role/actor", "role/ref", "weight_sync", shared, "p2p/0", single],
        ["role/critic", shared, single]]
    both_trained = communicators.communicators_of(make_plan("actor+critic=2,rollout=1", 3, 3), zero_stage=0)
    assert [names.count(single) for names in both_trained] == [1, 1, 0]


def test_a_one_model_placement_holds_its_role_group_and_no_message_group():
    plan = make_plan("actor=2", 2, 2)
    assert communicators.message_groups_of(plan) == {}
    assert communicators.communicators_of(plan, zero_stage=1) == [["role/actor"], ["role/actor"]]
    assert communicators.communicators_of(plan, zero_stage=0) == [["role/actor", communicators.SINGLETON]] * 2


def test_each_role_is_charged_for_the_busiest_of_its_ranks():
    plan = make_plan(*SEPARATE)
    gb = communicators.NCCL_COMMUNICATOR_GB
    assert communicators.buffers_gb(plan, zero_stage=3) == pytest.approx(
        {"actor": 6 * gb, "critic": 4 * gb, "reward": 3 * gb, "rollout": 4 * gb})  # rollout: rank 3's 4, not 4's 2
    result = communicators.annotate({"roles": {name: {} for name in plan.roles}}, plan, zero_stage=3)
    assert {name: row["communicators"] for name, row in result["roles"].items()} == {
        "actor": 6, "critic": 4, "reward": 3, "rollout": 4}
    assert result["max_groups_per_rank"] == 6 and result["nccl_communicator_gb"] == gb


def test_a_ranks_memory_is_its_roles_own_plus_its_communicators():
    """The role's row holds its memory with the role's own communicator buffers; a rank is charged for those it
    holds itself instead (a rank of a colocated pair reads the row of its first role)."""
    plan = make_plan("actor+ref=2,critic=1,rollout@actor", 3, 3)
    result = {"roles": {"actor": {"memory_gb_per_rank": 10.0, "breakdown_gb": {"nccl": 3.6}},
                        "critic": {"memory_gb_per_rank": 5.0, "breakdown_gb": {}}}}
    gb = communicators.NCCL_COMMUNICATOR_GB
    assert communicators.rank_memory_gb(result, plan, rank=1, communicators=2) == pytest.approx(10.0 - 3.6 + 2 * gb)
    assert communicators.rank_memory_gb(result, plan, rank=2, communicators=3) == pytest.approx(5.0 + 3 * gb)
