"""The RL step's route table (hpc_rlhf/rl/routes.py), pure: who sends each message of a step to whom, which routes
get a group of their own, and that no rank holds more of them as engines are added."""

import pytest

from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.rl import routes

# 6 ranks as 2 nodes of 3: actor+ref 0-1, reward 2, critic 3, rollout 4-5 (one engine of 2).
COLOCATED = ("actor+ref=2,critic=1,reward=1,rollout=2,rollout_tp=2", 6, 3)
# Hybrid: rollout engines [0,1] and [2,3] on the actor's ranks; critic 4-5.
HYBRID = ("actor=4,critic=2,rollout@actor,rollout_tp=2", 6, 6)


def test_routes_go_to_the_ranks_that_consume_them():
    """The engines' first ranks to the hub, the batch from the hub to every scoring rank, scores to the trained roles
    (rank 0 logs), evaluation responses and the critic's figures to rank 0 alone; pure, so every rank computes the
    same."""
    table = routes.routes_of(make_plan(*COLOCATED))
    found = {key: (r.src, r.ranks) if isinstance(r, routes.Route) else ("to", r.dst, r.ranks)
              for key, r in table.items()}
    assert found == {
        "engines": ("to", 4, (4,)), "responses": (4, (0, 1, 2, 3, 4)), "eval": (4, (0, 4)),
        "scores/actor": (0, (0, 1, 3)), "scores/critic": (3, (0, 1, 3)), "scores/ref": (0, (0, 1, 3)),
        "scores/reward": (2, (0, 1, 2, 3)), "scores/rules": (2, (0, 1, 2, 3)), "figures/critic": ("to", 0, (0, 1, 3))}
    grpo = routes.routes_of(make_plan("actor=1,ref=1,rollout=2", 4, 4))
    assert grpo["engines"].ranks == (2, 3) and grpo["engines"].dst == 2
    assert grpo["responses"].src == 2 and grpo["responses"].ranks == (0, 1, 2)
    assert grpo["scores/actor"].ranks == (0,) and grpo["scores/rules"].src == 0  # no reward model: the actor
    assert "figures/critic" not in grpo
    hybrid = routes.routes_of(make_plan("actor+ref=1,rollout@actor", 1, 1))
    assert {r.ranks for r in hybrid.values()} == {(0,)}  # one rank: nothing travels


def test_a_lora_actor_sends_the_reference_from_its_own_leader():
    """ref_mode=adapter_disabled (issue 27): no ref role; the actor's ranks score the reference with the adapter
    off, and its leader sends it to the trained roles on the same ranks as the actor's own scores."""
    plan = make_plan("actor=2,critic=1,rollout=1", 4, 4)
    table = routes.routes_of(plan, ref_role="actor")
    assert (table["scores/ref"].src, table["scores/ref"].ranks) == (0, (0, 1, 2)) == \
        (table["scores/actor"].src, table["scores/actor"].ranks)
    assert "scores/ref" not in routes.routes_of(plan)
    assert routes.Routes(plan, ref_role="actor").message_groups()["scores/ref"] == (0, 1, 2)


def test_a_jobs_routes_are_one_object_built_from_its_plan_and_reference_role():
    """The recipe builds the table once and passes it on (no table held by a module for a call order to set): a
    route it does not have is named with the ones it has, and a reference role the plan lacks is refused."""
    plan = make_plan("actor=2,critic=1,rollout=1", 4, 4)
    table = routes.Routes(plan, ref_role="actor")
    assert table["scores/ref"] == routes.routes_of(plan, ref_role="actor")["scores/ref"]
    assert "scores/ref" in table and "scores/ref" not in routes.Routes(plan)
    with pytest.raises(KeyError, match="no route 'scores/reward'.*routes: engines, responses"):
        table["scores/reward"]
    with pytest.raises(ValueError, match="'critic2', which this placement does not have"):
        routes.Routes(plan, ref_role="critic2")


def test_only_routes_of_three_ranks_or_more_get_a_group():
    assert routes.message_groups(make_plan(*COLOCATED)) == {
        "responses": (0, 1, 2, 3, 4), "scores/actor": (0, 1, 3), "scores/critic": (0, 1, 3),
        "scores/ref": (0, 1, 3), "scores/reward": (0, 1, 2, 3), "scores/rules": (0, 1, 2, 3),
        "figures/critic": (0, 1, 3)}
    assert routes.point_to_point_pairs(make_plan(*COLOCATED)) == {(0, 4)}  # eval: the hub to rank 0


def test_no_rank_holds_more_route_groups_as_engines_are_added():
    """The groups and point-to-point peers the routes give a rank do not grow with the number of engines."""
    def most(placement, world):
        plan = make_plan(placement, world, 8)
        member = {}
        for ranks in set(routes.message_groups(plan).values()):
            for r in ranks:
                member[r] = member.get(r, 0) + 1
        for pair in routes.point_to_point_pairs(plan):
            for r in pair:
                member[r] = member.get(r, 0) + 1
        return max(member.values())

    small = most("actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp=4", 32)
    assert small == most("actor=64,critic=32,ref=16,reward=16,rollout=128,rollout_tp=2", 256) == \
        most("actor=256,critic=128,ref=64,reward=64,rollout=512,rollout_tp=1", 1024) == 4
    # nor with more scoring roles on ranks of their own: their scores share one group with the trained ranks
    assert most("actor=64,critic=32,ref=16,teacher=16,reward=16,reward2=16,rollout=96,rollout_tp=2", 256) == 4


def test_a_hub_that_scores_keeps_its_batch():
    """Hybrid: the hub (rank 0, the first engine's first rank) is an actor rank too, so it takes the batch it sends
    (`keeps`) though nothing travels to it; the same for the evaluation it sends to itself. Where the engines have
    ranks of their own, the hub only sends."""
    table = routes.Routes(make_plan(*HYBRID))
    batch = table["responses"]
    assert (batch.src, batch.keeps) == (0, True)
    assert batch.consumers == (1, 2, 3, 4, 5) and batch.takers == (0, 1, 2, 3, 4, 5)
    evaluation = table["eval"]
    assert (evaluation.ranks, evaluation.consumers, evaluation.takers) == ((0,), (), (0,))
    apart = routes.Routes(make_plan(*COLOCATED))["responses"]
    assert (apart.src, apart.keeps) == (4, False) and apart.takers == apart.consumers == (0, 1, 2, 3)
    # Rank 0 logs and leads the actor: it keeps the actor's scores and sends them to the other trained ranks.
    actor_scores = routes.Routes(make_plan(*COLOCATED))["scores/actor"]
    assert (actor_scores.keeps, actor_scores.consumers, actor_scores.takers) == (True, (1, 3), (0, 1, 3))


def test_each_reward_model_sends_its_own_scores():
    """reward, reward2, reward3: one `scores/ROLE` route each from the model's leader to the trained ranks, over
    one group of the trained ranks and the three leaders (each leader gets the others' scores too); every model
    receives the batch; the rule rewards run on the first model's leader."""
    table = routes.Routes(make_plan("actor=1,critic=1,reward=1,reward2=1,reward3=1,rollout=1", 6, 6))
    assert {key: (table[key].src, table[key].ranks) for key in table.keys() if key.startswith("scores/reward")} == {
        "scores/reward": (2, (0, 1, 2, 3, 4)), "scores/reward2": (3, (0, 1, 2, 3, 4)),
        "scores/reward3": (4, (0, 1, 2, 3, 4))}
    assert table["scores/actor"].ranks == table["scores/critic"].ranks == (0, 1)  # the trained ranks alone
    assert table["responses"].consumers == (0, 1, 2, 3, 4)
    assert table.rule_reward_rank == table["scores/rules"].src == 2


def test_the_rule_rewards_run_on_the_first_reward_models_leader_else_on_the_actors():
    without = make_plan("actor=2,critic=1,rollout=1", 4, 4)
    assert routes.rule_reward_rank(without) == 0 == routes.Routes(without)["scores/rules"].src
    # actor 0-1, critic 2, reward 3-4, reward2 5, rollout 6
    with_two = make_plan("actor=2,critic=1,reward=2,reward2=1,rollout=1", 7, 7)
    assert routes.rule_reward_rank(with_two) == 3 == routes.Routes(with_two)["scores/rules"].src
    assert routes.Routes(with_two)["scores/rules"].ranks == (0, 1, 2, 3, 5)  # reward2's leader shares the group
    on_the_actor = make_plan("actor+reward=2,critic=1,rollout=1", 4, 4)  # the reward model shares ranks 0-1
    assert routes.rule_reward_rank(on_the_actor) == 0


def test_engine_leaders_are_each_engines_first_rank_in_engine_order():
    """With rollout_tp > 1 only an engine's first rank talks to the hub: the engines' gather has one rank each."""
    three = make_plan("actor=2,rollout=6,rollout_tp=2", 8, 8)
    assert routes.engine_leaders(three) == (2, 4, 6)
    gather = routes.routes_of(three)["engines"]
    assert (gather.dst, gather.ranks, gather.senders) == (2, (2, 4, 6), (4, 6))
    # Two nodes of 5: each engine of 3 stays on its node (ranks 2-4 and 7-9).
    two_nodes = make_plan("actor=2,critic=1,reward=1,rollout=6,rollout_tp=3", 10, 5)
    assert two_nodes.role("rollout").engines == ((2, 3, 4), (7, 8, 9))
    assert routes.engine_leaders(two_nodes) == (2, 7)
    assert routes.engine_leaders(make_plan(*HYBRID)) == (0, 2)


def test_a_placement_without_engines_has_only_the_score_routes():
    plan = make_plan("actor=1,critic=1", 2, 2)
    assert routes.engine_leaders(plan) == ()
    assert list(routes.routes_of(plan)) == ["scores/actor", "scores/critic", "scores/rules", "figures/critic"]
    assert routes.message_groups(plan) == {}  # two ranks: point to point
    assert routes.point_to_point_pairs(plan) == {(0, 1)}


def test_a_route_or_gather_of_two_ranks_or_fewer_needs_no_group():
    assert not routes.travels_over_a_group(routes.Route("eval", 0, (0,), keeps=True))
    assert not routes.travels_over_a_group(routes.Route("eval", 4, (0, 4)))
    assert routes.travels_over_a_group(routes.Route("scores/actor", 0, (0, 1, 3), keeps=True))
    assert not routes.travels_over_a_group(routes.Gather("engines", 2, (2, 7)))
    assert routes.travels_over_a_group(routes.Gather("engines", 2, (2, 4, 6)))
