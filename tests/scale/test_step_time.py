"""The step-time model on hand-computed cases, its critical paths, and `plan --step-time`."""

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from hpc_rlhf.cli import main
from hpc_rlhf.dist.memory import PRESETS, ModelShape
from hpc_rlhf.dist.placement import make_plan
from hpc_rlhf.scale import hardware, step_time
from hpc_rlhf.scale.step_time import StepSettings

# A model and a machine with round numbers: 4 layers of width 64, 1 GFLOP/s, 1 GB/s, no overheads.
SHAPE = ModelShape(hidden=64, layers=4, heads=4, kv_heads=4, intermediate=128, vocab=100, name="round")
MACHINE = hardware.Profile("round", peak_flops=1e9, memory_bytes_per_s=1e9, intra_node_bytes_per_s=1e8,
                           inter_node_bytes_per_s=1e7, latency_s=0.0, memory_gb=80, mfu_train=0.5, mfu_score=0.5,
                           mfu_decode=0.5, memory_efficiency=1.0, decode_step_overhead_s=0.0, pass_overhead_s=0.0,
                           optimizer_step_overhead_s=0.0, bytes_per_param=2)
SETTINGS = StepSettings(prompts=4, samples=2, prompt_len=8, response_len=4, micro_batch_size=8, zero_stage=0,
                        gradient_checkpointing=False, rollout_seqs=8)
PLAN = make_plan("actor=1,critic=1,ref=1,reward=1,rollout=2", 6, 6)
REPO = Path(__file__).resolve().parents[2]


def test_generation_is_a_prefill_and_memory_bound_decode_steps():
    # each engine: 2 prompts x 2 samples = 4 sequences in one wave
    n = SHAPE.num_params
    attention = lambda context: 4 * 4 * 4 * 16 * context  # noqa: E731  layers x heads x head size x context x 4
    prefill = 4 * 8 * (2 * n + attention(4)) / (1e9 * 0.5)
    kv = 2 * 4 * 4 * 16 * 2  # K and V, layers, heads, head size, bf16
    read = (4 * 2 * n + 4 * 4 * (8 + 2) * kv) / 1e9  # 4 steps read the weights, 16 tokens their KV cache
    compute = 4 * 4 * (2 * n + attention(10)) / (1e9 * 0.5)
    want = prefill + max(read, compute)
    assert step_time.generation_s(PLAN, SHAPE, SETTINGS, MACHINE) == pytest.approx(want)
    # responses of 4 tokens on average but up to 6: two more steps, each reading the weights again
    longer = StepSettings(**{**SETTINGS.__dict__, "max_response_len": 6})
    assert step_time.generation_s(PLAN, SHAPE, longer, MACHINE) == pytest.approx(
        prefill + max(read + 2 * 2 * n / 1e9, compute))


def test_training_is_three_forwards_at_the_training_mfu():
    got = step_time.training_s(PLAN, {"actor": SHAPE, "critic": SHAPE}, SETTINGS, MACHINE)
    assert got["actor"] == pytest.approx(3 * step_time.forward_flops(SHAPE, 8, 12) / (1e9 * 0.5))
    checkpointed = step_time.training_s(PLAN, {"actor": SHAPE, "critic": SHAPE},
                                        StepSettings(**{**SETTINGS.__dict__, "gradient_checkpointing": True}), MACHINE)
    assert checkpointed["actor"] == pytest.approx(got["actor"] * 4 / 3)


def test_weight_sync_follows_the_bucket_schedule():
    # Every tensor of the round model is small: the whole model (~0.07 MB) is one bucket of 1 MB, sent once over
    # the link to the rollout ranks (here on the other node)
    two_nodes = make_plan("actor=2,critic=1,rollout=3", 6, 3)
    assert two_nodes.role("rollout").nodes == (1,) and two_nodes.role("actor").nodes == (0,)
    got = step_time.weight_sync_s(two_nodes, SHAPE, StepSettings(bucket_mb=1.0, zero_stage=0), MACHINE)
    assert got == pytest.approx(2 * SHAPE.num_params / 1e7)
    # a bucket smaller than a tensor: that tensor goes alone, straight through, and waits for its send
    big = ModelShape(hidden=1024, layers=1, heads=8, kv_heads=8, intermediate=1024, vocab=1024, name="big")
    got = step_time.weight_sync_s(two_nodes, big, StepSettings(bucket_mb=1.0, zero_stage=0), MACHINE)
    assert got == pytest.approx(2 * big.num_params / 1e7)  # nothing overlaps: the link carries every byte


def test_asynchronous_rl_overlaps_generation_with_scoring_and_training():
    shapes = {"actor": SHAPE}
    sync = step_time.predict(PLAN, shapes, SETTINGS, MACHINE)
    ahead = step_time.predict(PLAN, shapes, StepSettings(**{**SETTINGS.__dict__, "max_staleness": 1}), MACHINE)
    p = sync["phases"]
    assert sync["total_s"] == pytest.approx(sum(p.values()), rel=1e-4)
    assert ahead["total_s"] == pytest.approx(p["exchange"] + max(p["generation"], p["scoring"] + p["training"])
                                             + p["weight_sync"], rel=1e-4)
    assert ahead["total_s"] < sync["total_s"]
    with pytest.raises(step_time.StepTimeError, match="disjoint"):
        step_time.predict(make_plan("actor=2,rollout@actor", 2, 2), shapes,
                          StepSettings(max_staleness=1), MACHINE)


def test_shared_cores_slow_a_phase_by_busy_ranks_over_cores():
    cpu = hardware.Profile(**{**MACHINE.to_dict(), "cores": 2})
    alone = step_time.predict(PLAN, {"actor": SHAPE}, SETTINGS, MACHINE)["phases"]["scoring"]
    shared = step_time.predict(PLAN, {"actor": SHAPE}, SETTINGS, cpu)["phases"]["scoring"]
    assert shared == pytest.approx(alone * 4 / 2, rel=1e-4)  # four scoring ranks on two cores


def test_plan_step_time_json(capsys):
    code = main(["plan", "--world-size", "32", "--gpus-per-node", "8", "--model", "7b", "--json",
                 "--placement", "actor=4,critic=4,ref=4,reward=4,rollout=16,rollout_tp=4", "--step-time",
                 "--hardware", "h100", "--max-staleness", "1"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    phases = result["step_time"]["phases"]
    assert set(phases) == set(step_time.PHASES) and all(v > 0 for v in phases.values())
    assert result["step_time"]["total_s"] < sum(phases.values())  # generation overlaps
    assert math.isfinite(result["step_time"]["total_s"])


def test_the_cpu_profile_is_read_from_where_calibrate_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RLHF_CPU_PROFILE", str(tmp_path / "cpu.json"))
    with pytest.raises(hardware.ProfileError, match="run `hpc-rlhf plan --calibrate`"):
        hardware.load("cpu")
    measured = hardware.Profile(**{**MACHINE.to_dict(), "name": "cpu", "cores": 2})
    assert hardware.save_cpu_profile(measured, {"when": "now"}) == tmp_path / "cpu.json"
    assert hardware.load("cpu") == measured
    (tmp_path / "cpu.json").write_text("{}")
    with pytest.raises(hardware.ProfileError, match="calibrate again"):
        hardware.load("cpu")


# --------------------------------------------------------------------------------- sequence parallel (issue 40)
SP_PLAN = make_plan("actor=2,critic=1,ref=1,reward=1,rollout=1,actor_sp=2", 6, 6)  # one block of 2, in one node


def test_the_all_to_all_of_a_sequence_block_by_hand():
    # 64 tokens over a block of 2: each rank holds 32; per layer q, k, v and the output are 32 x 4 heads x 16 x
    # 2 bytes = 4,096 bytes each, half of which leaves the rank: 4 x 2,048 x 4 layers = 32,768 bytes
    assert step_time.sequence_exchange_bytes(SHAPE, 64, 2, 2) == 32768
    # grouped-query attention, 4 heads and 2 key/value heads: K = 2 divides them (k and v are half as wide), K = 4
    # does not (they travel repeated to 4 heads)
    gqa = ModelShape(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=100, name="gqa")
    assert step_time.sequence_exchange_bytes(gqa, 64, 2, 2) == 4 * 32 * (2 * 64 + 2 * 32) * 2 / 2  # 24,576
    assert step_time.sequence_exchange_bytes(gqa, 64, 4, 2) == 4 * 16 * (4 * 64) * 2 * 3 / 4  # 24,576
    assert step_time.sequence_exchange_bytes(SHAPE, 64, 1, 2) == 0
    # the actor of SP_PLAN: 8 samples of 12 tokens in one block, one pass. Scoring: 4 layers x 48 tokens per rank
    # x 512 bytes x 1/2 = 49,152 bytes at the node's 1e8 B/s, plus the log-probs' all-gather (96 tokens x 4 bytes
    # x 1/2 = 192 bytes); training without checkpointing runs the all-to-alls twice (forward, backward), with it
    # three times (the forward recomputed)
    a2a, gather = 49152 / 1e8, 192 / 1e8
    by_role = step_time.sequence_exchange_by_role(SP_PLAN, {k: SHAPE for k in ("actor", "critic", "ref", "reward")},
                                                  SETTINGS, MACHINE)
    assert by_role == {"actor": {"scoring": pytest.approx(a2a + gather), "training": pytest.approx(2 * a2a + gather)}}
    checkpointed = StepSettings(**{**SETTINGS.__dict__, "gradient_checkpointing": True})
    assert step_time.sequence_exchange_by_role(SP_PLAN, {"actor": SHAPE}, checkpointed, MACHINE)["actor"][
        "training"] == pytest.approx(3 * a2a + gather)
    # a block spread over two nodes of one rank each crosses the 1e7 B/s link: ten times as long
    across = make_plan("actor=2,critic=1,rollout=1,actor_sp=2", 4, 1)
    assert step_time.sequence_exchange_s(across, "actor", SHAPE, 8, 12, 1, 1, MACHINE) == pytest.approx(
        (49152 + 192) / 1e7)
    # a latency per all-to-all (4 a layer) and per gather, in every pass
    slow = hardware.Profile(**{**MACHINE.to_dict(), "latency_s": 1e-3})
    assert step_time.sequence_exchange_s(SP_PLAN, "actor", SHAPE, 8, 12, 2, 1, slow) == pytest.approx(
        a2a + gather + (4 * 4 * 2 + 2) * 1e-3)


def test_a_sequence_block_shares_its_samples_work_and_adds_its_exchanges():
    # 2 actor ranks: as 2 replicas each trains 4 samples; as 1 block of 2 each rank computes half of 8 samples.
    # The FLOPs per rank are the same; the block adds its exchanges and is the only term that differs
    shapes = {kind: SHAPE for kind in ("actor", "critic", "ref", "teacher", "reward")}
    replicas = make_plan("actor=2,critic=1,ref=1,reward=1,rollout=1", 6, 6)
    exchange = step_time.sequence_exchange_by_role(SP_PLAN, shapes, SETTINGS, MACHINE)["actor"]
    assert step_time.training_s(SP_PLAN, shapes, SETTINGS, MACHINE)["actor"] == pytest.approx(
        step_time.training_s(replicas, shapes, SETTINGS, MACHINE)["actor"] + exchange["training"])
    assert step_time.training_s(replicas, shapes, SETTINGS, MACHINE)["actor"] == pytest.approx(
        3 * step_time.forward_flops(SHAPE, 4, 12) / (1e9 * 0.5))
    assert step_time.scoring_s(SP_PLAN, shapes, SETTINGS, MACHINE)["actor"] == pytest.approx(
        step_time.scoring_s(replicas, shapes, SETTINGS, MACHINE)["actor"] + exchange["scoring"])
    # micro-batches count per block: a block of 2 takes all 8 samples in passes of 1, twice a replica's 4, each
    # pass costing 1 s forward and 1 s backward: 8 s more
    ones = StepSettings(**{**SETTINGS.__dict__, "micro_batch_size": 1})
    overhead = hardware.Profile(**{**MACHINE.to_dict(), "pass_overhead_s": 1.0})
    no_exchange = {"scoring": 0.0, "training": 0.0}
    got = step_time.training_s(SP_PLAN, shapes, ones, overhead)["actor"] \
        - step_time.sequence_exchange_by_role(SP_PLAN, shapes, ones, overhead)["actor"]["training"]
    assert got == pytest.approx(step_time.training_s(replicas, shapes, ones, overhead)["actor"] + 2 * 4)
    # the prediction shows the exchanges apart, as the part of a phase taken by the roles that set it: with the
    # actor alone (GRPO-like), all of its exchanges; in SP_PLAN the critic's rank, with all 8 samples, sets both
    # phases and exchanges nothing, so the actor's figure is by role only
    alone = make_plan("actor=2,rollout=1,actor_sp=2", 3, 3)
    sp = step_time.predict(alone, shapes, SETTINGS, MACHINE)
    assert sp["detail"]["sequence_exchange_s"] == pytest.approx(exchange, abs=1e-6)  # rounded to the us
    assert sp["phases"]["training"] == pytest.approx(sp["detail"]["training_by_role_s"]["actor"], abs=1e-6)
    sp = step_time.predict(SP_PLAN, shapes, SETTINGS, MACHINE)
    assert sp["detail"]["sequence_exchange_s"] == no_exchange
    assert sp["detail"]["sequence_exchange_by_role_s"] == {"actor": pytest.approx(exchange, abs=1e-6)}
    assert step_time.predict(replicas, shapes, SETTINGS, MACHINE)["detail"]["sequence_exchange_s"] == no_exchange


def test_blocks_of_one_rank_change_nothing():
    # actor_sp=1 is the placement without the key: the same prediction, no exchange; and the 70B step of
    # docs/planner.md's step-time section is still the 520.590 s it printed before sequence parallelism
    shapes = {"actor": SHAPE}
    plain = step_time.predict(PLAN, shapes, SETTINGS, MACHINE)
    ones = make_plan("actor=1,critic=1,ref=1,reward=1,rollout=2,actor_sp=1,critic_sp=1,ref_sp=1,reward_sp=1", 6, 6)
    assert step_time.predict(ones, shapes, SETTINGS, MACHINE) == plain
    assert plain["detail"]["sequence_exchange_s"] == {"scoring": 0.0, "training": 0.0}
    assert plain["detail"]["sequence_exchange_by_role_s"] == {}
    flagship = make_plan("actor=8,critic=8,ref=4,reward=4,rollout=8,rollout_tp=4", 32, 8)
    settings = StepSettings(prompts=128, samples=8, prompt_len=512, response_len=1024, micro_batch_size=1,
                            rollout_seqs=128)
    got = step_time.predict(flagship, {"actor": PRESETS["70b"]}, settings, hardware.load("h100"))
    assert round(got["total_s"], 3) == 520.590


def _sbatch_allocation(path: Path) -> tuple[int, int]:
    text = path.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.MULTILINE).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.MULTILINE).group(1))
    return nodes * gpus, gpus


def test_the_32k_token_70b_example_predicts_its_sequence_exchange(capsys):
    # examples/long_context/ppo_70b_32k.yaml on sbatch/ppo_70b.sbatch's allocation, its batch as the step-time flags
    cfg = yaml.safe_load((REPO / "examples/long_context/ppo_70b_32k.yaml").read_text())
    world, gpus = _sbatch_allocation(REPO / "sbatch/ppo_70b.sbatch")
    prompt_len = cfg["data"]["max_prompt_len"]
    response_len = cfg["data"]["max_len"] - prompt_len
    samples = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["n_samples"]
    argv = ["plan", "--world-size", str(world), "--gpus-per-node", str(gpus), "--model", "70b", "--adam-offload",
            "--placement", cfg["placement"], "--seq-len", str(cfg["data"]["max_len"]),
            "--micro-batch-size", str(cfg["train"]["micro_batch_size"]), "--rollout-seqs", str(samples),
            "--step-time", "--hardware", "h100", "--prompts", str(cfg["rollout"]["prompts_per_step"]),
            "--samples", str(cfg["rollout"]["n_samples"]), "--prompt-len", str(prompt_len),
            "--response-len", str(response_len), "--train-batch", str(cfg["train"]["batch_size"])]
    assert main([*argv, "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["step_time"]
    exchange = predicted["detail"]["sequence_exchange_s"]
    assert math.isfinite(predicted["total_s"]) and exchange["scoring"] > 0 and exchange["training"] > 0
    assert exchange["training"] < predicted["phases"]["training"]
    by_role = predicted["detail"]["sequence_exchange_by_role_s"]
    assert set(by_role) == {"actor", "critic", "ref", "reward"}
    # the actor: 2 blocks of 4 in one node each, 16 samples of 32,768 tokens a block, one a pass; per layer
    # 4 all-to-alls of 8,192 tokens x (2 x 64 + 2 x 8 heads) x 128 x 2 bytes, 3/4 leaving the rank, at 450 GB/s,
    # 20 us each, three times in training (gradient checkpointing); the log-probs' all-gather once a pass
    tokens = 16 * 32768
    a2a = 80 * tokens / 4 * 144 * 128 * 2 * 3 / 4 / 450e9 + 4 * 80 * 16 * 20e-6
    gather = 4 * tokens * 3 / 4 / 450e9 + 16 * 20e-6
    assert by_role["actor"] == {"scoring": pytest.approx(a2a + gather, abs=1e-6),
                                "training": pytest.approx(3 * a2a + gather, abs=1e-6)}
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^training +[\d.]+\n  of which sequence_exchange +[\d.]+$", printed, re.MULTILINE)
    # docs/planner.md ("Long contexts") shows this phase table
    table = printed[printed.index("phase "):printed.index("critical path:")]
    assert table in (REPO / "docs" / "planner.md").read_text()


def test_a_token_budget_counts_passes_by_the_blocks_tokens():
    """rl.micro_batch_tokens: as many passes as the block's tokens need at the mean length, at most one per sample;
    each pass costs the profile's pass overhead, so the training phase shows the count."""
    overhead = hardware.Profile(**{**MACHINE.to_dict(), "pass_overhead_s": 1.0})
    shapes = {"actor": SHAPE, "critic": SHAPE}
    by = {}
    for name, changes in {"one sample a pass": {"micro_batch_size": 1},
                          "one pass": {"micro_batch_size": 8},
                          "two samples' tokens": {"micro_batch_tokens": 2 * SETTINGS.seq_len},
                          "half a sample's": {"micro_batch_tokens": SETTINGS.seq_len // 2}}.items():
        settings = StepSettings(**{**SETTINGS.__dict__, **changes})
        by[name] = step_time.training_s(PLAN, shapes, settings, overhead)["actor"]
    samples = SETTINGS.sequences  # the actor's one rank trains them all
    assert by["one sample a pass"] - by["one pass"] == pytest.approx(2 * (samples - 1))  # forward and backward
    assert by["two samples' tokens"] - by["one pass"] == pytest.approx(2 * (samples // 2 - 1))
    assert by["half a sample's"] == pytest.approx(by["one sample a pass"])  # a longer sample goes alone
