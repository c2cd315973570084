"""The RL configuration's reference of a LoRA actor (issue 27): which reference `ref_mode=auto` chooses, the roles
the placement must then hold, and the contradictions refused before any rank starts (the one-line messages are in
tests/test_bad_inputs.py's table); and the settings of the HTTP endpoints (issue 35): URLs, caps, headers, and
endpoints whose worst case outlasts dist.timeout_s."""

from __future__ import annotations

import re

import pytest

from hpc_rlhf.config import ConfigError, load_config, save_config
from hpc_rlhf.rl import grpo, ppo
from hpc_rlhf.rl.config import reference_mode, slow_endpoints

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
    (["train.group_by_length=true"], "train.group_by_length sorts a one-model mode's rows; an RL step's "
                                     "micro-batches are cut from its samples: rl.padding_free"),
])
def test_contradictions_are_refused_at_configuration(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(grpo.Config, None, overrides)
    if "rank=600" in " ".join(overrides):  # the hf engine has no such limit
        load_config(grpo.Config, None, [o for o in overrides if o != "rollout.backend=vllm"])


def test_endpoints_slower_than_the_collective_timeout_are_named_with_their_figures():
    # the defaults: 3 tries of 60 s with pauses of 0.5 and 1 s, + 1 s margin = 182.5 s a call; reset and 4 steps
    cfg = load_config(grpo.Config, None, ["env.http_url=http://env:8000?lang=en", "reward.functions=[]"])
    [line] = slow_endpoints(cfg)
    assert line.startswith("env.http_url http://env:8000?...: one episode may wait 912.5 s on its environment "
                           "(reset and env.max_turns = 4 steps, each up to (env.retries + 1 = 3) tries of "
                           "env.timeout_s = 60 s with the pauses between them), more than dist.timeout_s = 300 s")
    assert slow_endpoints(load_config(grpo.Config, None, ["env.http_url=http://env:8000", "env.timeout_s=10",
                                                          "env.retries=1", "reward.functions=[]"])) == []
    cfg = load_config(grpo.Config, None, ["reward.http_url=http://judge/score", "reward.http_timeout_s=100",
                                          "dist.timeout_s=120"])
    assert slow_endpoints(cfg) == [
        "reward.http_url http://judge/score: one call may take 303 s (3 tries of reward.http_timeout_s = 100 s with "
        "the pauses between them), more than dist.timeout_s = 120 s, after which the other ranks give up waiting: "
        "lower reward.http_timeout_s or raise dist.timeout_s"]


@pytest.mark.parametrize("overrides, message", [
    (["reward.http_url=ftp://judge/score"], "reward.http_url must start with http:// or https://"),
    (["reward.http_url=http://me:pw@judge/score"], "reward.http_url holds a user name or password"),
    (["reward.http_url=http://judge", "reward.http_max_reply_mb=0"], "reward.http_max_reply_mb must be > 0"),
    (["reward.http_url=http://judge", "reward.http_headers_from_env={Authorization: not-a-variable}"],
     "reward.http_headers_from_env: header Authorization must name an environment variable"),
    (["env.http_url=http://env", "env.headers_from_env={'X Y': TOKEN}", "reward.functions=[]"],
     "env.headers_from_env: 'X Y' is not an HTTP header name"),
])
def test_endpoint_settings_are_checked_before_any_rank_starts(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(grpo.Config, None, overrides)
    assert ":pw@" not in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    (["env.http_url=http://env:8000/x?key=s3cret", "reward.functions=[]"],
     "command line: env.http_url holds a credential in the query parameter 'key' ('http://env:8000/x?...'), which "
     "config.yaml and logs would keep: send it as a header whose value is read from an environment variable named in "
     "env.headers_from_env (e.g. env.headers_from_env: {Authorization: MY_TOKEN}) and remove it from the URL"),
    (["reward.http_url=https://judge/score?lang=en&token=s3cret"],
     "command line: reward.http_url holds a credential in the query parameter 'token' ('https://judge/score?...'), "
     "which config.yaml and logs would keep: send it as a header whose value is read from an environment variable "
     "named in reward.http_headers_from_env"),
    (["reward.http_url=http://me:s3cret@judge/score"],
     "command line: reward.http_url holds a user name or password ('http://judge/score'), which config.yaml and logs "
     "would keep: send it as a header whose value is read from an environment variable named in "
     "reward.http_headers_from_env"),
])
def test_a_url_carrying_a_credential_is_refused_in_one_line_naming_the_key_without_the_secret(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(grpo.Config, None, overrides)
    line = str(caught.value)
    assert line.startswith(message) and "\n" not in line and "s3cret" not in line


def test_a_saved_config_keeps_ordinary_queries_and_the_names_of_header_variables_but_no_header_value(tmp_path,
                                                                                                     monkeypatch):
    monkeypatch.setenv("HPC_RLHF_TEST_JUDGE_TOKEN", "Bearer s3cret")
    cfg = load_config(grpo.Config, None, ["reward.http_url=http://judge/score?lang=en",
                                          "reward.http_headers_from_env={Authorization: HPC_RLHF_TEST_JUDGE_TOKEN}",
                                          "env.http_url=http://env:8000?lang=en",
                                          "env.headers_from_env={X-Api-Key: HPC_RLHF_TEST_JUDGE_TOKEN}"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "http_url: http://judge/score?lang=en" in saved and "HPC_RLHF_TEST_JUDGE_TOKEN" in saved
    assert "s3cret" not in saved


TEACHER = "distill.teacher=examples/tiny/assets/models/llama-tiny"


@pytest.mark.parametrize("overrides, message", [
    ([TEACHER, "placement=actor+ref=1,rollout@actor"], "the placement has no 'teacher' role, which this config needs"),
    (["placement=actor+ref+teacher=1,rollout@actor"], "the placement has a 'teacher' role but distill.teacher names "
                                                      "no teacher model folder"),
    (["reward.functions=[]"], "no reward: set reward.models, reward.functions, reward.http_url, an environment "
                              "(env.name, env.http_url), or a teacher to distill from (distill.teacher)"),
])
def test_a_teacher_and_its_role_come_together(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(grpo.Config, "examples/tiny/grpo.yaml", overrides)


def test_a_teacher_alone_is_a_reward_enough_and_sits_on_its_own_or_the_actors_ranks():
    for placement in ("actor+ref+teacher=1,rollout@actor", "actor=1,ref=1,teacher=1,rollout=1"):
        cfg = load_config(grpo.Config, "examples/tiny/grpo.yaml", [TEACHER, "reward.functions=[]",
                                                                   f"placement={placement}"])
        assert cfg.distill.teacher.endswith("llama-tiny") and cfg.distill.coef == 1.0


def test_packed_rows_too_short_for_the_longest_sample_are_refused_before_any_rank_starts():
    """Found at configuration, not at the first step's pack (data.max_prompt_len 16 + rollout.max_new_tokens 6)."""
    with pytest.raises(ConfigError, match=re.escape("rl.padding_free_row_tokens=16 is shorter than the longest sample "
                                                    "(data.max_prompt_len + rollout.max_new_tokens = 22)")):
        load_config(grpo.Config, "examples/tiny/grpo.yaml", ["rl.padding_free=true", "rl.padding_free_row_tokens=16"])
    load_config(grpo.Config, "examples/tiny/grpo.yaml", ["rl.padding_free=true", "rl.padding_free_row_tokens=22"])
