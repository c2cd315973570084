"""The RL configuration's reference of a LoRA actor (issue 27): which reference `ref_mode=auto` chooses, the roles
the placement must then hold, and the contradictions refused before any rank starts (the one-line messages are in
tests/test_bad_inputs.py's table)."""

from __future__ import annotations

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.rl import grpo, ppo
from hpc_rlhf.rl.config import reference_mode

LORA = ["actor.lora.rank=8"]
NO_REF = "placement=actor=1,rollout=1"


@pytest.mark.parametrize("overrides, mode", [
    ([], "model"),  # full fine-tuning: a reference model on its own ranks, as before
    ([*LORA, NO_REF], "adapter_disabled"),  # a LoRA actor: its base is the reference
    ([*LORA, NO_REF, "ref_path=runs/sft/final"], "adapter_disabled"),  # ref_path = actor.path: the same base
    ([*LORA, "ref_path=elsewhere"], "model"),  # another reference folder: a reference model
    ([*LORA, "ref_mode=model"], "model"),  # asked for
])
def test_auto_makes_the_base_of_a_lora_actor_its_reference(overrides, mode):
    assert reference_mode(load_config(grpo.Config, None, overrides)) == mode


def test_the_reference_of_a_lora_actor_needs_no_ref_role():
    cfg = load_config(ppo.Config, None, [*LORA, "placement=actor=1,critic=1,reward=1,rollout=1"])
    assert "ref" not in cfg.placement and cfg.rl.kl_coef > 0
    load_config(grpo.Config, None, [*LORA, "placement=actor=1,rollout@actor"])  # hybrid, one rank


@pytest.mark.parametrize("overrides, message", [
    (["ref_mode=adapter_disabled", NO_REF], "ref_mode=adapter_disabled uses the LoRA actor with its adapter off as "
                                            "the reference, but actor.lora.rank is 0"),
    ([*LORA, "ref_mode=adapter_disabled", NO_REF, "ref_path=other"], "ref_path='other' contradicts "
                                                                     "ref_mode=adapter_disabled"),
    ([*LORA], "the 'ref' role would hold an unused copy: remove it from the placement, or set ref_mode=model"),
    ([*LORA, "ref_mode=model", NO_REF], "the placement has no 'ref' role, which this config needs"),
    (["actor.lora.rank=600", NO_REF, "rollout.backend=vllm"], "actor.lora.rank=600 is larger than the vllm rollout "
                                                             "engine allows (LoRA rank at most 512"),
])
def test_contradictions_are_refused_at_configuration(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(grpo.Config, None, overrides)
    if "rank=600" in " ".join(overrides):  # the hf engine has no such limit
        load_config(grpo.Config, None, [o for o in overrides if o != "rollout.backend=vllm"])
