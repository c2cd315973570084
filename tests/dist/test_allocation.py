"""hpc_rlhf.dist.allocation: the one check of a job against an allocation, shared by `hpc-rlhf plan` (flags) and a
mode's --dry-run (config keys). Refusals are one line starting with the name the caller gave the setting."""

import pytest

from hpc_rlhf.dist.allocation import Allocation, AllocationError, RoleLoad, check_allocation, plan_on, refusal
from hpc_rlhf.dist.memory import DEFAULT_OVERHEAD_GB, ModelShape, estimate

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
