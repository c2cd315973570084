"""hpc_rlhf/runtime/process_rewards.py: a process reward model is recognised by its config's record, and scores the
markers of the responses (not the prompts') as the same computation on each sample alone does; the RL recipes'
scorer counts the markers the policy generated (not an environment's); generate's scorer those after the prompt."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hpc_rlhf.config import TINY_ASSETS, ConfigError
from tests.distributed import REPO

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"
RECORD = {"placeholder_token": "#", "reward_tokens": ["+", "-"]}


def make_prm_folder(folder):
    """The tiny model as a process reward model folder (`hpc-rlhf prm` records the marker and reward tokens)."""
    shutil.copytree(REPO / TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "process_reward": RECORD}))
    return folder


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory):
    return make_prm_folder(tmp_path_factory.mktemp("prm") / "prm")


@pytest.fixture(scope="module")
def tokenizer():
    from hpc_rlhf.models.builders import load_tokenizer

    return load_tokenizer(REPO / TINY_MODEL, pad_to_eos=True)


def test_the_record_names_the_models_tokens_in_the_policys_ids(prm_folder, tokenizer, tmp_path):
    from hpc_rlhf.runtime.process_rewards import process_reward_spec

    spec = process_reward_spec(prm_folder, tokenizer, "reward.models[0]")
    ids = tokenizer.convert_tokens_to_ids(["#", "+", "-"])
    assert (spec.marker_id, spec.reward_ids) == (ids[0], tuple(ids[1:]))
    assert process_reward_spec(REPO / TINY_MODEL, tokenizer, "reward.models[0]") is None  # an outcome model
    broken = tmp_path / "broken"
    shutil.copytree(prm_folder, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "process_reward": {"placeholder_token": "#"}}))
    with pytest.raises(ConfigError, match=r"reward.models\[1\]: '.*broken/config.json' has a process_reward record "
                                          r"without a placeholder_token and two or more reward_tokens"):
        process_reward_spec(broken, tokenizer, "reward.models[1]")
    (broken / "config.json").write_text(json.dumps({**config, "process_reward": {**RECORD,
                                                                                  "placeholder_token": "##"}}))
    with pytest.raises(ConfigError, match=r"reward.models\[1\] placeholder_token='##' is 2 tokens"):
        process_reward_spec(broken, tokenizer, "reward.models[1]")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_steps_are_the_markers_where_the_mask_allows_one():
    from hpc_rlhf.runtime.process_rewards import step_positions

    m = 9
    input_ids = torch.tensor([[m, 1, m, m], [2, m, 3, 0], [4, 5, 6, 7]])
    may_be_step = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert step_positions(input_ids, may_be_step, m) == [[2, 3], [1], []]


def by_hand(model, spec, prompt: list[int], response: list[int], how: str) -> float:
    """A sample's reward computed alone, unpadded: the response's markers' first-reward-token probabilities."""
    sequence = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=sequence).logits[0]
    steps = [torch.softmax(logits[j, list(spec.reward_ids)], dim=-1)[0].item()
             for j in range(len(prompt), sequence.shape[1]) if sequence[0, j] == spec.marker_id]
    if not steps:
        return 0.0
    return {"min": min, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s),
            "product": lambda s: float(torch.tensor(s).prod())}[how](steps)


PROMPTS = ["1#2=", "3+4=", "9+9="]  # a marker in a prompt is no step of the response
RESPONSES = ["2+5=7#1#17#<eos>", "7", "18#"]


def test_a_batchs_rewards_are_its_steps_scores_aggregated_as_computed_alone(prm_folder, tokenizer):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.data.examples import pad_collate
    from hpc_rlhf.runtime.process_rewards import process_reward_spec, process_rewards

    model = AutoModelForCausalLM.from_pretrained(prm_folder).eval()
    spec = process_reward_spec(prm_folder, tokenizer, "reward.models[0]")
    prompts = [ids(tokenizer, p) for p in PROMPTS]
    responses = [ids(tokenizer, r) for r in RESPONSES]
    batch = pad_collate([{"input_ids": p + r} for p, r in zip(prompts, responses)], tokenizer.pad_token_id)
    positions = torch.arange(batch["input_ids"].shape[1])[None, :]
    after_prompt = (positions >= torch.tensor([len(p) for p in prompts])[:, None]) & (batch["attention_mask"] > 0)
    expected = {}
    for how in ("min", "last", "mean", "product"):
        with torch.no_grad():
            got = process_rewards(model, batch["input_ids"], batch["attention_mask"], after_prompt, spec, how)
        expected[how] = [by_hand(model, spec, p, r, how) for p, r in zip(prompts, responses)]
        assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected[how], abs=1e-6)
    assert expected["min"][0] < expected["mean"][0] < 1 and expected["min"][1] == 0.0  # three steps; none
