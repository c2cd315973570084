"""The groups of a placement as data: creation order and membership (dist/group_layout.py), without torch."""

from hpc_rlhf.dist.group_layout import group_specs, held_by
from hpc_rlhf.dist.placement import make_plan


def test_roles_then_the_weight_sync_group_then_message_groups_in_sorted_order_of_their_rank_lists():
    plan = make_plan("actor+ref=2,critic=1,reward=1,rollout=2,rollout_tp=2", 6, 3)
    specs = group_specs(plan, {"wide": (4, 3, 2, 1, 0), "pair": (3, 0), "pair-again": (0, 3), "three": (0, 1, 3)})
    assert [(s.desc, s.ranks) for s in specs] == [
        ("role/actor", (0, 1)), ("role/critic", (3,)), ("role/ref", (0, 1)), ("role/reward", (2,)),
        ("weight_sync", (0, 4, 5)), ("wide", (0, 1, 2, 3, 4)), ("three", (0, 1, 3)), ("pair,pair-again", (0, 3))]
    assert [s.desc for s in held_by(3, specs)] == ["role/critic", "wide", "three", "pair,pair-again"]
    assert [s.desc for s in held_by(5, specs)] == ["weight_sync"]


def test_sequence_groups_follow_the_role_groups_one_per_block_in_plan_order():
    plan = make_plan("actor+ref=4,critic=2,rollout=2,actor_sp=2,ref_sp=4,critic_sp=2", 8, 8)
    specs = group_specs(plan, {"pair": (0, 6)})
    assert [(s.desc, s.ranks, s.kind) for s in specs] == [
        ("role/actor", (0, 1, 2, 3), "role"), ("role/critic", (4, 5), "role"), ("role/ref", (0, 1, 2, 3), "role"),
        ("sequence/actor/0", (0, 1), "sequence"), ("sequence/actor/1", (2, 3), "sequence"),
        ("sequence/critic/0", (4, 5), "sequence"), ("sequence/ref/0", (0, 1, 2, 3), "sequence"),
        ("weight_sync", (0, 6, 7), "weight_sync"), ("pair", (0, 6), "message")]
    assert [s.desc for s in held_by(2, specs)] == ["role/actor", "role/ref", "sequence/actor/1", "sequence/ref/0"]
    # a role that is not sequence parallel has no sequence group
    assert not [s for s in group_specs(make_plan("actor=4,critic=4", 8, 8)) if s.kind == "sequence"]
