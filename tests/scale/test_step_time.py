"""The step-time model on hand-computed cases, its critical paths, and `plan --step-time`."""

import json
import math

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.dist.memory import ModelShape
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
