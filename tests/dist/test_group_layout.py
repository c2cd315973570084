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
