import random

import pytest

from hpc_rlhf.dist.placement import PlacementError, RoleSpec, format_ranks, make_plan, parse_spec, role_kind


def r(a, b):
    return tuple(range(a, b + 1))


def test_16_rank_layout_from_the_design():
    plan = make_plan("actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2", 16, 8)
    assert list(plan.roles) == ["actor", "critic", "ref", "reward", "rollout"]
    assert plan.role("actor").ranks == r(0, 3)
    assert plan.role("critic").ranks == (4, 5)
    assert plan.role("ref").ranks == (6,)
    assert plan.role("reward").ranks == (7,)
    assert plan.role("rollout").ranks == r(8, 15)
    assert plan.role("rollout").engines == ((8, 9), (10, 11), (12, 13), (14, 15))
    assert plan.role("actor").nodes == (0,) and plan.role("rollout").nodes == (1,)
    assert all(p.colocated_with is None for p in plan.roles.values())
    assert plan.rollout_tp == 2 and not plan.is_hybrid


@pytest.mark.parametrize("tp", [2, 4])
def test_openrlhf_70b_layout_on_32_ranks(tp):
    plan = make_plan(f"actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp={tp}", 32, 8)
    assert plan.role("actor").ranks == r(0, 3)
    assert plan.role("critic").ranks == r(4, 7)
    assert plan.role("ref").ranks == r(8, 11)
    assert plan.role("reward").ranks == r(12, 15)
    assert plan.role("rollout").ranks == r(16, 31)
    assert plan.role("rollout").nodes == (2, 3)
    engines = plan.role("rollout").engines
    assert len(engines) == 16 // tp and all(len(e) == tp for e in engines)
    assert engines[0] == r(16, 16 + tp - 1)
    for engine in engines:
        assert len({rank // 8 for rank in engine}) == 1
    assert plan.num_nodes == 4


def test_every_rank_belongs_to_exactly_its_roles():
    plan = make_plan("actor+ref=4,critic+reward=2,rollout=2", 8, 8)
    assert plan.roles_of_rank(0) == ["actor", "ref"]
    assert plan.roles_of_rank(4) == ["critic", "reward"]
    assert plan.roles_of_rank(7) == ["rollout"]
    covered = sorted(rank for p in plan.roles.values() for rank in p.ranks)
    assert covered == sorted(list(range(4)) * 2 + [4, 5] * 2 + [6, 7])


def test_colocation_shares_ranks_both_ways():
    plan = make_plan("actor+ref=4,critic+reward=2,rollout=2,rollout_tp=2", 8, 8)
    assert plan.role("actor").ranks == plan.role("ref").ranks == r(0, 3)
    assert plan.role("critic").ranks == plan.role("reward").ranks == (4, 5)
    assert plan.role("actor").colocated_with == "ref" and plan.role("ref").colocated_with == "actor"
    assert plan.role("critic").colocated_with == "reward" and plan.role("reward").colocated_with == "critic"
    assert plan.role("rollout").engines == ((6, 7),)


def test_hybrid_rollout_runs_on_the_actor_ranks():
    plan = make_plan("actor=4,critic=2,rollout@actor,rollout_tp=2", 6, 6)
    assert plan.role("rollout").ranks == plan.role("actor").ranks == r(0, 3)
    assert plan.role("rollout").engines == ((0, 1), (2, 3))
    assert plan.role("rollout").colocated_with == "actor"
    assert plan.role("critic").ranks == (4, 5)
    assert plan.is_hybrid


def test_hybrid_engines_of_a_multi_node_actor_stay_inside_nodes():
    plan = make_plan("actor+ref=12,critic=4,rollout@actor,rollout_tp=4", 16, 8)
    assert plan.role("actor").ranks == r(0, 11)
    assert plan.role("critic").ranks == r(12, 15)
    assert plan.role("rollout").engines == (r(0, 3), r(4, 7), r(8, 11))


def test_single_model_layout_spans_nodes():
    plan = make_plan("actor=16", 16, 8)
    assert list(plan.roles) == ["actor"]
    assert plan.role("actor").ranks == r(0, 15) and plan.role("actor").nodes == (0, 1)


def test_several_reward_models_string_and_yaml_forms_agree():
    from_string = make_plan("actor=4,reward=1,reward2=1,reward3=2", 8, 8)
    from_mapping = make_plan({"actor": 4, "reward": [1, 1, 2]}, 8, 8)
    from_list = make_plan(["actor=4", {"reward": [1, 1]}, "reward3=2"], 8, 8)
    assert from_string == from_mapping == from_list
    assert [p.kind for p in from_string.roles.values()] == ["actor", "reward", "reward", "reward"]
    assert from_string.role("reward2").ranks == (5,) and from_string.role("reward3").ranks == (6, 7)


def test_yaml_mapping_with_hybrid_and_colocation():
    plan = make_plan({"actor+ref": 4, "rollout@actor": None, "rollout_tp": 2}, 4, 4)
    assert plan.role("ref").ranks == r(0, 3) and plan.role("rollout").engines == ((0, 1), (2, 3))


def test_world_smaller_than_a_node_is_one_node():
    plan = make_plan("actor=2,rollout=2,rollout_tp=2", 4, 8)
    assert plan.num_nodes == 1 and plan.role("rollout").ranks == (2, 3)


def test_tight_packing_keeps_engines_whole_where_largest_first_would_not():
    # Placing actor and critic first would leave 2 + 2 free ranks for a 4-rank engine.
    plan = make_plan("actor=6,critic=6,rollout=4,rollout_tp=4", 16, 8)
    assert plan.role("actor").ranks == r(0, 5)
    assert plan.role("critic").ranks == r(6, 11)
    assert plan.role("rollout").engines == (r(12, 15),)
    assert plan.role("critic").nodes == (0, 1)


def test_roles_touch_as_few_nodes_as_possible():
    plan = make_plan("actor=8,critic=4,ref=2,reward=2,rollout=16,rollout_tp=8", 32, 8)
    for name, want in {"actor": 1, "critic": 1, "ref": 1, "reward": 1, "rollout": 2}.items():
        assert len(plan.role(name).nodes) == want, (name, plan.format_table())


def test_plan_is_deterministic_and_independent_of_entry_order():
    entries = ["actor=4", "critic=2", "ref=1", "reward=1", "rollout=8", "rollout_tp=2"]
    reference = make_plan(",".join(entries), 16, 8)
    rng = random.Random(0)
    for _ in range(10):
        rng.shuffle(entries)
        assert make_plan(" ".join(entries), 16, 8) == reference
    assert make_plan(",".join(entries), 16, 8).format_table() == reference.format_table()


def test_plan_queries_and_table():
    plan = make_plan("actor=4,critic=2,ref=1,reward=1,rollout=8,rollout_tp=2", 16, 8)
    assert plan.has("critic") and not plan.has("reward2")
    with pytest.raises(PlacementError, match=r"no role 'critc'.*actor, critic, ref, reward, rollout"):
        plan.role("critc")
    with pytest.raises(PlacementError, match="rank 16 is outside"):
        plan.roles_of_rank(16)
    table = plan.format_table()
    assert "rollout  8-15" in table and "4 x tp2: 8-9 10-11 12-13 14-15" in table
    assert plan.to_dict()["roles"]["critic"]["ranks"] == [4, 5]


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert format_ranks([5]) == "5" and format_ranks([]) == "-"


def test_parse_spec_records_colocation_and_hybrid():
    specs = parse_spec("actor+ref=4 rollout@actor rollout_tp=2")
    assert specs == [RoleSpec("actor", "actor", 4, ("ref",)), RoleSpec("ref", "ref", 4, ("actor",)),
                     RoleSpec("rollout", "rollout", None, (), "actor", 2)]
    assert role_kind("reward12") == "reward"


INVALID = [
    ("", 8, 8, r"placement is empty"),
    ("actor=4,critic=2", 8, 8, r"asks for 6 ranks \(actor=4 \+ critic=2\) but the world has 8"),
    ("actor=8,critic=2", 8, 8, r"asks for 10 ranks"),
    ("actor=4,actr=4", 8, 8, r"unknown role 'actr'; did you mean 'actor'"),
    ("actor=4,reward_2=4", 8, 8, r"unknown role 'reward_2'; the first reward model is 'reward'"),
    ("actor=4,actor=4", 8, 8, r"role 'actor' is given twice"),
    ("actor+ref=4,ref=4", 8, 8, r"role 'ref' is given twice"),
    ("actor=4,reward=2,reward=2", 8, 8, r"role 'reward' is given twice.*reward2, reward3"),
    ("actor=4,reward3=4", 8, 8, r"'reward3' is given without 'reward2'"),
    ("critic=4,rollout=4", 8, 8, r"no actor \(roles given: critic, rollout\)"),
    ("actor=4,rollout=3,rollout_tp=2,critic=1", 8, 8, r"rollout=3 cannot be cut into engines of rollout_tp=2"),
    ("actor=8,rollout=8,rollout_tp=8", 16, 4, r"rollout_tp=8 is larger than a node \(4 ranks\)"),
    ("actor=4,critic=4,rollout_tp=2", 8, 8, r"'rollout_tp=2' is given but there is no rollout role"),
    ("actor=6,critic=2,rollout@actor,rollout_tp=4", 8, 8,
     r"actor's 6 ranks \(rollout@actor\) cannot be cut into engines of rollout_tp=4"),
    ("actor=4,critic=4,rollout@critic", 8, 8, r"'rollout@critic': a hybrid rollout runs on the actor's ranks"),
    ("actor+rollout=4,critic=4", 8, 8, r"write 'rollout@actor'"),
    ("actor+bogus=4,critic=4", 8, 8, r"unknown role 'bogus'"),
    ("actor+actor=8", 8, 8, r"'actor\+actor=8' names a role twice"),
    ("actor=four", 8, 8, r"'actor=four': the count must be a whole number"),
    ("actor=0,critic=8", 8, 8, r"'actor=0': the count must be at least 1"),
    ("actor,critic=8", 8, 8, r"'actor' needs a count"),
    ("actor=4,rollout=4,rollout@actor", 8, 8, r"role 'rollout' is given twice"),
    ("actor=8,rollout@actor=8", 8, 8, r"hybrid rollout takes no count"),
    ("actor=4,rollout=4,rollout_tp=2,rollout_tp=2", 8, 8, r"'rollout_tp' is given twice"),
    ("actor=12", 12, 8, r"world size 12 is not a whole number of nodes of 8 ranks"),
    # 24 ranks on nodes of 6 hold at most 4 engines of 4 ranks, one per node.
    ("actor=4,rollout=20,rollout_tp=4", 24, 6,
     r"'rollout' \(20 ranks\) cannot be cut into rollout engines of rollout_tp=4 ranks without crossing"),
    ("actor=12,rollout@actor,rollout_tp=4", 12, 6,
     r"'actor' \(12 ranks\) cannot be cut into hybrid rollout engines"),
]


@pytest.mark.parametrize("spec,world,per_node,message", INVALID, ids=[i[0] or "empty" for i in INVALID])
def test_invalid_spec_is_refused_with_a_clear_message(spec, world, per_node, message):
    with pytest.raises(PlacementError, match=message) as info:
        make_plan(spec, world, per_node)
    assert isinstance(info.value, ValueError)


def test_error_shows_the_plan_so_far():
    with pytest.raises(PlacementError) as info:
        make_plan("actor=4,critic=2,rollout=4", 8, 8)
    text = str(info.value)
    assert "plan so far:" in text
    lines = text.splitlines()
    assert any(line.split()[:2] == ["actor", "4"] and "(not placed)" in line for line in lines)
    assert any(line.split()[:2] == ["rollout", "4"] for line in lines)


def test_wrong_spec_types_are_refused():
    with pytest.raises(PlacementError, match="only 'reward' takes a list"):
        parse_spec({"actor": [2, 2]})
    with pytest.raises(PlacementError, match="neither an entry"):
        parse_spec(["actor=4", 3])
    with pytest.raises(PlacementError, match="not int"):
        parse_spec(4)


# ------------------------------------------------------------------------------------------ sequence parallel
def test_sequence_parallel_keys_in_string_mapping_and_list_forms():
    text = make_plan("actor=8,critic=4,ref=4,reward=2,reward2=2,rollout=12,rollout_tp=4,actor_sp=4,critic_sp=2,"
                     "reward_sp=2", 32, 8)
    mapping = make_plan({"actor": 8, "critic": 4, "ref": 4, "reward": [2, 2], "rollout": 12, "rollout_tp": 4,
                         "actor_sp": 4, "critic_sp": "2", "reward_sp": 2}, 32, 8)
    listed = make_plan(["actor=8", "critic=4", "ref=4", "reward=2", "reward2=2", "rollout=12", {"rollout_tp": 4},
                        "actor_sp=4", {"critic_sp": 2}, "reward_sp=2"], 32, 8)
    assert text == mapping == listed
    assert [text.sequence_parallel(n) for n in ("actor", "critic", "ref", "reward", "reward2", "rollout")] == \
        [4, 2, 1, 2, 2, 1]
    actor = text.role("actor").ranks
    assert text.sequence_blocks("actor") == [actor[:4], actor[4:]]
    assert text.sequence_blocks("critic") == [text.role("critic").ranks[i:i + 2] for i in (0, 2)]
    assert text.sequence_blocks("ref") == [(r,) for r in text.role("ref").ranks]
    assert text.to_dict()["roles"]["actor"]["sequence_parallel"] == 4
    assert text.to_dict()["roles"]["ref"]["sequence_parallel"] == 1
    table = text.format_table()
    assert "sequence" in table.splitlines()[1]
    assert any(line.startswith("actor") and "sp=4: 2 block(s) of 4" in line for line in table.splitlines())
    assert any(line.startswith("reward2") and "sp=2" in line for line in table.splitlines())


def test_sequence_parallel_of_colocated_roles_and_the_teacher():
    plan = make_plan("actor+ref=8,teacher=4,rollout@actor,rollout_tp=2,actor_sp=8,ref_sp=2,teacher_sp=4", 12, 12)
    assert plan.sequence_blocks("actor") == [tuple(range(8))]
    assert plan.sequence_blocks("ref") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.sequence_blocks("teacher") == [(8, 9, 10, 11)]


def test_a_sequence_block_stays_inside_one_node_or_fills_whole_nodes():
    # critic=6 would otherwise straddle nodes 0-1 at an odd offset; as blocks of 2 each node holds whole blocks.
    plan = make_plan("actor=10,critic=6,critic_sp=2", 16, 8)
    for name in ("actor", "critic"):
        for block in plan.sequence_blocks(name):
            assert len({r // 8 for r in block}) == 1, (name, block, plan.format_table())
    wide = make_plan("actor=16,rollout=16,actor_sp=16", 32, 8)
    assert wide.sequence_blocks("actor") == [tuple(range(16))]
    assert wide.role("actor").nodes == (0, 1)


SEQUENCE_INVALID = [
    ("actor=6,critic=2,actor_sp=4", 8, 8, r"actor_sp=4 does not divide the actor's 6 ranks"),
    ("actor=4,reward=2,reward2=2,reward_sp=2,reward_sp=2", 8, 8, r"'reward_sp' is given twice"),
    ("actor=4,reward=2,reward2=2,reward_sp=4", 8, 8, r"reward_sp=4 does not divide the reward's 2 ranks"),
    ("actor=4,reward=4,reward2=2,reward_sp=4", 10, 10, r"reward_sp=4 does not divide the reward2's 2 ranks"),
    ("actor=6,rollout=2,critic_sp=2", 8, 8, r"'critic_sp=2' is given but the placement has no critic role"),
    ("actor=6,rollout=2,teacher_sp=2", 8, 8, r"'teacher_sp=2' is given but the placement has no teacher role"),
    ("actor=4,rollout=4,rollout_sp=2", 8, 8, r"'rollout_sp'.*use rollout_tp"),
    ("actor=8,actor_sp=0", 8, 8, r"'actor_sp=0': the count must be at least 1"),
    ("actor=8,actor_sp=two", 8, 8, r"'actor_sp=two': the count must be a whole number"),
    ("actor=12,rollout=4,actor_sp=12", 16, 8, r"blocks of 12 ranks \(actor_sp=12\), more than a node \(8 ranks\)"),
    # nodes of 6 hold one block of 4 of each role: 4 nodes give 16 ranks in blocks, the roles need 24
    ("actor=12,critic=12,actor_sp=4,critic_sp=4", 24, 6,
     r"cannot be cut into blocks of 4 ranks \((actor|critic)_sp=4\) without crossing a node boundary"),
]


@pytest.mark.parametrize("spec,world,per_node,message", SEQUENCE_INVALID, ids=[i[0] for i in SEQUENCE_INVALID])
def test_invalid_sequence_parallel_is_refused_naming_the_key(spec, world, per_node, message):
    with pytest.raises(PlacementError, match=message):
        make_plan(spec, world, per_node)
