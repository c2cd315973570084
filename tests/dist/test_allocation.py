"""hpc_rlhf.dist.allocation: the one check of a job against an allocation, shared by `hpc-rlhf plan` (flags) and a
mode's --dry-run (config keys). Refusals are one line starting with the name the caller gave the setting."""

import pytest

from hpc_rlhf.dist.allocation import Allocation, AllocationError, RoleLoad, check_allocation, plan_on, refusal
from hpc_rlhf.dist.memory import DEFAULT_OVERHEAD_GB, HOST_OVERHEAD_GB, ModelShape, estimate

SEVEN_B = ModelShape.preset("7b")
KEYS = {"zero_stage": "train.zero_stage", "adam_offload": "train.adam_offload", "share": "rollout.share",
        "micro_batch_size": "train.micro_batch_size"}


def loads(**by_kind):
    return lambda name, kind: by_kind.get(kind, RoleLoad(kind=kind, shape=SEVEN_B, zero_stage=3, keys=KEYS))


def test_memory_per_rank_is_the_memory_models_and_colocated_roles_add_up():
    report = check_allocation("actor+ref=4,rollout=4", Allocation(8, 8, 80.0), loads())
    actor = estimate("actor", SEVEN_B, 4, 3, overhead_gb=0)["total"]
    ref = estimate("ref", SEVEN_B, 4, 3, overhead_gb=0)["total"]
    assert report["roles"]["actor"]["memory_gb_per_rank"] == pytest.approx(actor + ref + DEFAULT_OVERHEAD_GB, abs=2e-3)
    assert report["fits"] and refusal(report) is None


def test_a_role_that_does_not_fit_is_refused_naming_the_first_setting_to_change():
    report = check_allocation("actor=8", Allocation(8, 8, 80.0, keys={"gpu_memory_gb": "--gpu-memory-gb"}),
                              loads(actor=RoleLoad(kind="actor", shape=ModelShape.preset("70b"), zero_stage=1,
                                                   keys=KEYS)))
    reason = refusal(report)
    assert not report["fits"] and "\n" not in reason
    assert reason.startswith("train.adam_offload: role 'actor' needs ")
    assert "train.adam_offload=true" in reason and "train.zero_stage=3" in reason and "--gpu-memory-gb" in reason


def test_a_role_whose_passes_are_cut_by_tokens_is_told_to_lower_the_budget_not_the_sample_count():
    keys = {**KEYS, "micro_batch_tokens": "rl.micro_batch_tokens"}
    long_passes = RoleLoad(kind="actor", shape=ModelShape.preset("70b"), zero_stage=3, micro_batch_size=4,
                           micro_batch_tokens=262_144, seq_len=8192, keys=keys)
    report = check_allocation("actor=8", Allocation(8, 8, 80.0), loads(actor=long_passes))
    reason = refusal(report)
    assert not report["fits"] and "a smaller rl.micro_batch_tokens (down to one sample's 8192 tokens)" in reason
    assert "train.micro_batch_size" not in reason
    one_sample = RoleLoad(kind="actor", shape=ModelShape.preset("70b"), zero_stage=3, micro_batch_size=4,
                          micro_batch_tokens=8192, seq_len=8192, keys=keys)
    row = check_allocation("actor=8", Allocation(8, 8, 80.0), loads(actor=one_sample))["roles"]["actor"]
    assert row["memory_gb_per_rank"] < report["roles"]["actor"]["memory_gb_per_rank"] - 30  # 32 passes' worth less


def test_a_vllm_engine_must_fit_its_share_of_the_gpu():
    capped = RoleLoad(kind="rollout", shape=SEVEN_B, tokens_in_flight=16 * 2048, gpu_share=0.2, keys=KEYS)
    report = check_allocation("actor=4,rollout=4", Allocation(8, 8, 80.0), loads(rollout=capped))
    row = report["roles"]["rollout"]
    assert row["memory_gb_per_rank"] < 80 and row["limit_gb"] == 16.0 and not row["fits"]
    assert refusal(report).startswith("rollout.share: role 'rollout' needs ")


def test_a_placement_that_does_not_fit_the_allocation_names_its_key_with_the_plan_as_detail():
    with pytest.raises(AllocationError) as refused:
        plan_on("actor=4,critic=2", Allocation(8, 8), "placement")
    assert refused.value.key == "placement" and "\n" not in str(refused.value)
    assert str(refused.value).startswith("placement: the placement asks for 6 ranks")
    assert "plan so far" in refused.value.detail


def test_settings_the_memory_model_refuses_name_their_key():
    bad = RoleLoad(kind="actor", shape=SEVEN_B, zero_stage=0, adam_offload=True, keys=KEYS)
    with pytest.raises(AllocationError, match=r"^train\.adam_offload: role 'actor': Adam offload needs ZeRO"):
        check_allocation("actor=8", Allocation(8, 8), loads(actor=bad))


# ------------------------------------------------------------------------------------------------ host memory
SEVENTY_B = ModelShape.preset("70b")


def offloading(kind: str) -> RoleLoad:
    return RoleLoad(kind=kind, shape=SEVENTY_B, zero_stage=3, adam_offload=True, keys=KEYS)


def test_each_node_adds_its_ranks_offloaded_adam_states_and_processes():
    """8 actor ranks on node 0 and 8 critic ranks on node 1, Adam offloaded: each node holds its role's whole
    fp32 master weights, m, v and gradients (16 bytes a parameter), plus a process allowance per rank."""
    report = check_allocation("actor=8,critic=8", Allocation(16, 8, 80.0, host_memory_gb=2048.0),
                              loads(actor=offloading("actor"), critic=offloading("critic")))
    actor_node, critic_node = report["host"]["gb_per_node"]
    assert actor_node == pytest.approx(16 * SEVENTY_B.params() / 1e9 + 8 * HOST_OVERHEAD_GB, rel=1e-3)
    assert critic_node == pytest.approx(16 * SEVENTY_B.params(lm_head=False) / 1e9 + 8 * HOST_OVERHEAD_GB, rel=1e-3)
    assert report["host"]["fits"] and report["fits"] and refusal(report) is None


def test_a_node_short_of_host_memory_is_refused_naming_the_offload():
    report = check_allocation("actor=8,critic=8", Allocation(16, 8, 80.0, host_memory_gb=512.0),
                              loads(actor=offloading("actor"), critic=offloading("critic")))
    reason = refusal(report)
    assert not report["fits"] and all(r["fits"] for r in report["roles"].values())  # the GPUs are not the problem
    assert reason.startswith("train.adam_offload: node 0 needs 1") and "more than 512 GB (--host-memory-gb)" in reason
    assert "the Adam states role 'actor' offloads" in reason and "\n" not in reason


def test_host_memory_is_checked_only_when_given_and_a_layout_without_offload_needs_only_the_processes():
    report = check_allocation("actor=8,critic=8", Allocation(16, 8, 80.0),
                              loads(actor=offloading("actor"), critic=offloading("critic")))
    assert report["host"]["limit_gb"] is None and report["host"]["fits"]
    plain = check_allocation("actor+ref=4,rollout=4", Allocation(8, 8, 80.0, host_memory_gb=40.0), loads())
    assert plain["host"]["gb_per_node"] == [8 * HOST_OVERHEAD_GB] and plain["host"]["fits"]
    short = check_allocation("actor+ref=4,rollout=4", Allocation(8, 8, 80.0, host_memory_gb=16.0), loads())
    assert refusal(short).startswith("--placement: node 0 needs 32 GB of host memory")


def test_a_node_memory_that_is_not_positive_is_refused_naming_the_flag():
    with pytest.raises(AllocationError, match=r"^--host-memory-gb: must be positive \(a node's memory in GB\), got 0"):
        check_allocation("actor=8", Allocation(8, 8, 80.0, host_memory_gb=0.0), loads())


def test_a_sleeping_vllm_engine_keeps_its_weights_in_host_memory():
    sleeping = RoleLoad(kind="rollout", shape=SEVEN_B, tokens_in_flight=1024, sleeps_on_host=True, keys=KEYS)
    awake = check_allocation("actor=4,rollout=4", Allocation(8, 8, 80.0), loads())
    asleep = check_allocation("actor=4,rollout=4", Allocation(8, 8, 80.0), loads(rollout=sleeping))
    weights = estimate("rollout", SEVEN_B, 4)["weights"]
    assert asleep["host"]["gb_per_node"][0] - awake["host"]["gb_per_node"][0] == pytest.approx(4 * weights, abs=0.2)


# --------------------------------------------------------------------------------- sequence parallel (issue 40)
SP_KEYS = KEYS | {"sequence_parallel": "placement"}
SEVENTY_B = ModelShape.preset("70b")


def long_rows(seq_len):
    return lambda name, kind: RoleLoad(kind=kind, shape=SEVENTY_B, zero_stage=3, adam_offload=kind == "actor",
                                       seq_len=seq_len, keys=SP_KEYS)


def test_a_role_split_over_k_ranks_holds_its_share_of_the_activations_and_shows_its_blocks():
    one = check_allocation("actor=8", Allocation(8, 8, 80.0), long_rows(32768))["roles"]["actor"]
    four = check_allocation("actor=8,actor_sp=4", Allocation(8, 8, 80.0), long_rows(32768))["roles"]["actor"]
    assert four["sequence_parallel"] == 4 and one["sequence_parallel"] == 1
    assert four["breakdown_gb"]["activations"] == pytest.approx(one["breakdown_gb"]["activations"] / 4, rel=0.03)
    assert "2 x sequence(4)" in four["groups"] and not any("sequence" in g for g in one["groups"])


def test_activations_that_do_not_fit_are_refused_naming_the_roles_sp_key_and_a_k_that_fits():
    report = check_allocation("actor=8", Allocation(8, 8, 80.0), long_rows(32768))
    reason = refusal(report)
    assert not report["fits"] and "\n" not in reason
    # at actor_sp=1 the actor needs ~104 GB, ~60 of them activations; at 2 it needs ~75 GB
    assert reason.startswith("placement: role 'actor' needs 10")
    assert "try actor_sp=2 in placement (activations take 6" in reason
    fixed = check_allocation("actor=8,actor_sp=2", Allocation(8, 8, 80.0), long_rows(32768))
    assert fixed["fits"]


def test_the_sp_key_of_a_second_reward_model_is_reward_sp():
    # 7B reward models scoring rows of 256k tokens on GPUs of 40 GB: 46 GB each, 36.5 of them activations
    seven_b = lambda name, kind: RoleLoad(kind=kind, shape=SEVEN_B, zero_stage=3, seq_len=262144, keys=SP_KEYS)
    report = check_allocation("actor=4,reward=2,reward2=2", Allocation(8, 8, 40.0), seven_b)
    assert not report["roles"]["reward2"]["fits"]
    assert report["_advice"]["reward2"].startswith("placement: role 'reward2' needs 46.0 GB per GPU")
    assert "try reward_sp=2 in placement" in report["_advice"]["reward2"]


def test_activations_that_are_not_the_problem_give_no_sp_advice():
    # ZeRO-0 70B weights and Adam states alone are far beyond 80 GB: splitting rows cannot help
    load = lambda name, kind: RoleLoad(kind=kind, shape=SEVENTY_B, zero_stage=0, keys=SP_KEYS)
    reason = refusal(check_allocation("actor=8", Allocation(8, 8, 80.0), load))
    assert "_sp" not in reason


def test_k_must_divide_the_attention_heads():
    twelve = ModelShape(hidden=768, layers=2, heads=12, kv_heads=4, intermediate=3072, vocab=1000, name="tiny-12")
    load = lambda name, kind: RoleLoad(kind=kind, shape=twelve, keys=SP_KEYS)
    with pytest.raises(AllocationError, match=r"^--placement: actor_sp=8 does not divide the 12 attention heads of "
                                              r"actor's model tiny-12"):
        check_allocation("actor=8,actor_sp=8", Allocation(8, 8, 80.0), load)
    assert check_allocation("actor=8,actor_sp=4", Allocation(8, 8, 80.0), load)["fits"]  # 4 KV heads divide too
    assert check_allocation("actor=6,actor_sp=6", Allocation(6, 6, 80.0), load)["fits"]  # KV heads repeated
