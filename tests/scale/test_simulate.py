"""`hpc-rlhf simulate`: the real set-up of 32-, 256- and 1,024-rank RL jobs in one process, on the fake backend."""

import json

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.dist import bucket_plan
from hpc_rlhf.dist.exchange import HEADER_LEN
from hpc_rlhf.dist.memory import ModelShape
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.scale import communicators

LAYOUT_32 = "actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp=4"
LAYOUT_256 = "actor=64,critic=32,ref=16,reward=16,rollout=128,rollout_tp=2"
LAYOUT_1024 = "actor=256,critic=128,ref=64,reward=64,rollout=512,rollout_tp=1"
SMALL_BATCH = ["--prompts", "16", "--samples", "2", "--response-len", "8", "--eval-rows", "4"]


def simulate(capsys, world, placement, *extra, model="7b"):
    code = main(["simulate", "--world-size", str(world), "--gpus-per-node", "8", "--model", model,
                 "--placement", placement, "--json", *SMALL_BATCH, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[-1])


@pytest.fixture(scope="module")
def world_32():
    capture = pytest.MonkeyPatch()
    import io
    import sys
    buffer = io.StringIO()
    capture.setattr(sys, "stdout", buffer)
    try:
        code = main(["simulate", "--world-size", "32", "--gpus-per-node", "8", "--model", "7b", "--placement",
                     LAYOUT_32, "--json", *SMALL_BATCH])
    finally:
        capture.undo()
    assert code == 0
    return json.loads(buffer.getvalue().splitlines()[-1])


def test_32_ranks_groups_order_and_communicators(world_32):
    result = world_32
    assert result["world_size"] == 32 and result["planner_agrees"] is True
    # 4 role groups, the weight-sync group, then the message groups: the engines' first ranks, the batch's
    # consumers and two sets of score receivers (the trained ranks; those and the ref's and reward model's leaders);
    # the same list on every rank (or the simulation raises)
    assert result["new_group_calls"] == 9
    assert result["new_group_order"][:5] == ["role/actor", "role/critic", "role/ref", "role/reward", "weight_sync"]
    by_rank = {r["rank"]: r for r in result["ranks"]}
    # rank 0: its role, the weight-sync group, the batch's group, two score groups and the hub (eval)
    assert by_rank[0]["communicators"] == 6 and by_rank[0]["peers"] == [16]
    assert by_rank[17]["communicator_names"] == ["weight_sync"]  # a rollout rank that leads no engine
    assert result["max_groups_per_rank"] == 6


def test_32_ranks_bytes_are_what_the_messages_carry(world_32):
    by_rank = {r["rank"]: r for r in world_32["ranks"]}
    samples, length = 16 * 2, 8
    responses = 4 * (samples + 2 * samples * length)  # lengths, ids, log-probs: 4-byte words
    scores = 4 * (3 * samples * length + samples)  # actor, critic, ref per token; the reward model per sample
    assert by_rank[1]["phases"]["exchange"]["received"] == responses + scores  # an actor rank
    # the weight sync, second time: one header naming the first sync's layout, then the buckets of bucket_plan
    shape = ModelShape.preset("7b")
    buckets = bucket_plan.messages([(n, k, "bf16", 2) for n, k in shape.streamed_tensors()], 256 * 2**20)
    sync = by_rank[17]["phases"]["weight_sync"]
    assert sync["messages"] == 1 + len(buckets)
    assert sync["received"] == 8 * HEADER_LEN + 2 * shape.num_params
    assert by_rank[0]["phases"]["weight_sync"]["sent"] == 16 * sync["received"]  # to the 16 rollout ranks


def test_the_planners_memory_is_what_each_rank_holds(world_32, capsys):
    assert main(["plan", "--world-size", "32", "--gpus-per-node", "8", "--model", "7b", "--placement", LAYOUT_32,
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    for name, row in planned["roles"].items():
        ranks = [r for r in world_32["ranks"] if name in r["roles"]]
        assert max(r["memory_gb"] for r in ranks) == pytest.approx(row["memory_gb_per_rank"], abs=2e-3), name
        assert max(r["communicators"] for r in ranks) == row["communicators"], name


def test_1024_ranks_hold_no_more_communicators_than_256(capsys):
    """The bound of the route redesign, on the real set-up, under ZeRO-0 (DeepSpeed's model-parallel group of one
    rank counted on the trained ranks: the most a rank holds)."""
    big = simulate(capsys, 1024, LAYOUT_1024, "--zero-stage", "0")
    small = simulate(capsys, 256, LAYOUT_256, "--zero-stage", "0")
    assert big["planner_agrees"] and small["planner_agrees"]
    assert big["max_groups_per_rank"] == small["max_groups_per_rank"] == 7
    assert big["new_group_calls"] == small["new_group_calls"] == 9
    # rank 0: its role, the weight-sync group, the batch's group, two score groups, the hub (eval) and
    # DeepSpeed's model-parallel group; under ZeRO 1-3 DeepSpeed leaves the last one unused
    worst = next(r for r in big["ranks"] if r["rank"] == 0)
    assert worst["communicators"] == 7 and communicators.SINGLETON in worst["communicator_names"]
    assert max(map(len, communicators.communicators_of(make_plan(LAYOUT_1024, 1024, 8), zero_stage=3))) == 6


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize("change, flag", [
    (["--world-size", "0"], "--world-size: must be at least 1"),
    (["--placement", "actor=4,rollout=2"], "--placement: the placement asks for 6 ranks"),
    (["--hardware", "tpu"], "--hardware: unknown hardware profile 'tpu'; profiles: h100, h200, a100, cpu"),
    (["--model", "EMPTY"], "has no config.json"),
])
def test_bad_input_is_refused_in_one_line(capsys, tmp_path, command, change, flag):
    args = {"--world-size": "32", "--gpus-per-node": "8", "--model": "7b", "--placement": LAYOUT_32}
    for key, value in zip(change[::2], change[1::2]):
        args[key] = str(tmp_path) if value == "EMPTY" else value
    argv = [command, *(x for kv in args.items() for x in kv)]
    if command == "plan" and "--hardware" in args:
        argv.append("--step-time")
    code = main(argv)
    out, err = capsys.readouterr()
    # the one line on stderr; on stdout only what shows why (a placement's plan so far), as a dry run refuses
    assert code == 2 and (out == "" or out.startswith("plan so far:"))
    assert err.count("\n") == 1 and err.startswith(f"hpc-rlhf {command}: ") and flag in err, err


def test_256_ranks_with_the_actor_in_sequence_blocks_of_4_add_one_communicator_on_the_actors_ranks(capsys):
    """actor_sp=4 on LAYOUT_256's 64 actor ranks: 16 blocks, 16 more new_group calls on every rank (in the same
    order), and one more communicator on an actor rank (its block), none elsewhere: 8 at most under ZeRO-0 (7
    without sequence blocks). The count does not grow with the job: 1,024 ranks with the actor in blocks of 4 hold
    as many as 256 (counted by the planner, which the simulation agrees with on every rank)."""
    plain = simulate(capsys, 256, LAYOUT_256, "--zero-stage", "0")
    split = simulate(capsys, 256, LAYOUT_256 + ",actor_sp=4", "--zero-stage", "0")
    assert split["planner_agrees"] is True
    assert split["new_group_calls"] == plain["new_group_calls"] + 16
    order = split["new_group_order"]
    assert order[order.index("role/reward") + 1:order.index("weight_sync")] == [f"sequence/actor/{i}"
                                                                                   for i in range(16)]
    assert split["max_groups_per_rank"] == plain["max_groups_per_rank"] + 1 == 8
    plan = make_plan(LAYOUT_256 + ",actor_sp=4", 256, 8)
    for before, after in zip(plain["ranks"], split["ranks"]):
        extra = 1 if after["rank"] in plan.role("actor").ranks else 0
        assert after["communicators"] == before["communicators"] + extra, after["rank"]
    rank_5 = next(r for r in split["ranks"] if r["rank"] == 5)
    assert ["sequence/actor/1", 4] in rank_5["groups"]
    big = make_plan(LAYOUT_1024 + ",actor_sp=4", 1024, 8)
    assert max(map(len, communicators.communicators_of(big, zero_stage=0))) == 8
    assert max(map(len, communicators.communicators_of(big, zero_stage=3))) == 7


def test_a_hybrid_layout_runs_and_the_planner_agrees(capsys):
    """Engines on the actor's ranks: the hub (rank 0) generates and scores, nothing is synced over the network."""
    result = simulate(capsys, 16, "actor+ref=16,rollout@actor,rollout_tp=2", "--zero-stage", "0")
    assert result["planner_agrees"] is True
    hub = next(r for r in result["ranks"] if r["rank"] == 0)
    # its two role groups, the weight-sync group (created on the actor's ranks, unused by the hybrid engine:
    # counted all the same), one group for the batch and every score (the same ranks), the engines' group, and
    # DeepSpeed's model-parallel group (ZeRO-0); evaluation responses stay on rank 0
    assert hub["communicator_names"] == [
        "role/actor", "role/ref", "weight_sync", "responses,scores/actor,scores/ref,scores/rules", "engines",
        communicators.SINGLETON]
    assert all(r["phases"]["weight_sync"]["messages"] == 0 for r in result["ranks"])


def test_a_teacher_beside_the_reference_or_on_its_own_ranks_keeps_the_bound(capsys):
    """On-policy distillation's teacher at 256 ranks (the count does not grow with the job: the test above):
    colocated with the reference its scores leave from the reference's leader to the same ranks, over the same
    group; on ranks of its own its leader joins the one group the untrained scoring roles' leaders share with the
    trained ranks (hpc_rlhf.rl.routes), as a second reward model's does: 7 under ZeRO-0 either way."""
    beside = simulate(capsys, 256, "actor=64,critic=32,ref+teacher=16,reward=16,rollout=128", "--zero-stage", "0")
    apart = simulate(capsys, 256, "actor=64,critic=32,ref=16,teacher=16,reward=16,rollout=112", "--zero-stage", "0")
    assert beside["planner_agrees"] and apart["planner_agrees"]
    assert beside["max_groups_per_rank"] == apart["max_groups_per_rank"] == 7
    rank_0 = next(r for r in beside["ranks"] if r["rank"] == 0)
    assert "scores/ref,scores/teacher,scores/reward,scores/rules" in rank_0["communicator_names"]
    rank_0 = next(r for r in apart["ranks"] if r["rank"] == 0)
    assert "scores/ref,scores/teacher,scores/reward,scores/rules" in rank_0["communicator_names"]


LAYOUT_PPO_70B = "actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4"  # examples/cluster/ppo_70b.yaml's


def test_a_node_short_of_host_memory_is_refused_as_plan_refuses_it(capsys):
    """PPO of a 70B model with Adam offload keeps ~1.1 TB of Adam states on the actor's node and on the critic's:
    512 GB nodes are refused by the line `hpc-rlhf plan` prints, naming --adam-offload, exit 2; 2 TB nodes pass,
    and both outputs give each node's host memory."""
    job = ["--world-size", "32", "--gpus-per-node", "8", "--model", "70b", "--placement", LAYOUT_PPO_70B,
           "--adam-offload"]
    assert main(["plan", *job, "--host-memory-gb", "512"]) == 2
    planned = capsys.readouterr().err

    assert main(["simulate", *job, *SMALL_BATCH, "--host-memory-gb", "512"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("hpc-rlhf simulate: --adam-offload: node 0 needs 1136 GB"), err
    assert err.removeprefix("hpc-rlhf simulate") == planned.removeprefix("hpc-rlhf plan")
    assert "or no --adam-offload on GPUs" in err  # a switch is not given a value ("--adam-offload False")
    assert "node 0 1,136 GB, node 1 1,131 GB, node 2 32 GB, node 3 32 GB; node memory 512 GB: does NOT fit" in out

    result = simulate(capsys, 32, LAYOUT_PPO_70B, "--adam-offload", "--host-memory-gb", "2048", model="70b")
    assert result["host"]["limit_gb"] == 2048 and result["host"]["fits"]
    assert result["host"]["gb_per_node"] == [1135.6, 1131.4, 32.0, 32.0]
    assert "_host_refusal" not in result  # --json prints the public report
