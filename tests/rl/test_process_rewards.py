"""hpc_rlhf/rl/process_rewards.py: a process reward model in `reward.models` is recognised by its config's record,
scores the markers the policy generated (not the prompt's, not an environment's), and gives an RL run the same
rewards as the same computation written by hand as a rule function."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hpc_rlhf.config import TINY_ASSETS, ConfigError
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import REPO, hpc_rlhf_cli

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"
RECORD = {"placeholder_token": "#", "reward_tokens": ["+", "-"]}


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory):
    """The tiny model as a process reward model folder (`hpc-rlhf prm` records the marker and reward tokens)."""
    folder = tmp_path_factory.mktemp("prm") / "prm"
    shutil.copytree(REPO / TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "process_reward": RECORD}))
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    from hpc_rlhf.models.builders import load_tokenizer

    return load_tokenizer(REPO / TINY_MODEL, pad_to_eos=True)


def test_the_record_names_the_models_tokens_in_the_policys_ids(prm_folder, tokenizer, tmp_path):
    from hpc_rlhf.rl.process_rewards import process_reward_spec

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


def test_only_the_markers_the_policy_generated_are_steps(tokenizer):
    from hpc_rlhf.rl.batches import make_batch
    from hpc_rlhf.rl.process_rewards import response_markers

    marker = tokenizer.convert_tokens_to_ids("#")
    prompts = [ids(tokenizer, "1#2="), ids(tokenizer, "3+4="), ids(tokenizer, "5=")]
    responses = [torch.tensor(ids(tokenizer, "3#9#")), torch.tensor(ids(tokenizer, "7")),
                 torch.tensor(ids(tokenizer, "6#obs#8#"))]
    # the third is an episode whose "obs#" an environment wrote: a hole in the mask
    masks = [torch.ones(4), torch.ones(1), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id, masks=masks)
    assert response_markers(batch, marker) == [[5, 7], [], [3, 9]]
    assert all(batch.input_ids[i, j] == marker for i, found in enumerate([[5, 7], [], [3, 9]]) for j in found)


def test_a_batchs_rewards_are_its_steps_scores_aggregated_as_computed_alone(prm_folder, tokenizer):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.rl.batches import make_batch
    from hpc_rlhf.rl.process_rewards import process_reward_spec, process_scores_of

    model = AutoModelForCausalLM.from_pretrained(prm_folder).eval()
    spec = process_reward_spec(prm_folder, tokenizer, "reward.models[0]")
    prompts = [ids(tokenizer, "12+5="), ids(tokenizer, "3+4="), ids(tokenizer, "9+9=")]
    responses = [torch.tensor(ids(tokenizer, "2+5=7#1#17#") + [tokenizer.eos_token_id]),
                 torch.tensor(ids(tokenizer, "7")), torch.tensor(ids(tokenizer, "18#"))]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id)
    expected = {}
    for how in ("min", "last", "mean", "product"):
        with torch.no_grad():
            got = torch.cat(process_scores_of(model, spec, how)(batch)).tolist()
        for i, (p, r) in enumerate(zip(prompts, responses)):  # each sample alone, unpadded, by hand
            sequence = torch.tensor([p + r.tolist()])
            with torch.no_grad():
                logits = model(input_ids=sequence).logits[0]
            steps = [torch.softmax(logits[j, list(spec.reward_ids)], dim=-1)[0].item()
                     for j in range(len(p), sequence.shape[1]) if sequence[0, j] == spec.marker_id]
            expected[how, i] = {"min": min, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s),
                                "product": lambda s: float(torch.tensor(s).prod())}[how](steps) if steps else 0.0
        assert got == pytest.approx([expected[how, i] for i in range(3)], abs=1e-6)
    assert expected["min", 0] < expected["mean", 0] < 1 and expected["min", 1] == 0.0  # three steps; none


ORACLE = '''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.data.examples import prompt_examples

FOLDER = {folder!r}
MODEL = AutoModelForCausalLM.from_pretrained(FOLDER).eval()
TOKENIZER = AutoTokenizer.from_pretrained(FOLDER)
MARKER, GOOD, BAD = TOKENIZER.convert_tokens_to_ids(["#", "+", "-"])


def prm_min(prompts, responses, answers):
    """The process reward model's min-aggregated reward, from the texts the RL step hands a rule function."""
    out = []
    for prompt, response in zip(prompts, responses):
        start = prompt_examples(TOKENIZER, [prompt], max_prompt_len=16)[0]["input_ids"]
        sequence = start + TOKENIZER(response, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = MODEL(input_ids=torch.tensor([sequence])).logits[0]
        steps = [torch.softmax(logits[j, [GOOD, BAD]], dim=-1)[0].item()
                 for j in range(len(start), len(sequence)) if sequence[j] == MARKER]
        out.append(min(steps) if steps else 0.0)
    return out
'''


def test_an_rl_run_scores_with_it_as_the_same_computation_by_hand_does(prm_folder, tmp_path):
    """Two GRPO steps of the tiny model with the process reward model on a reward role, against the same steps
    with a rule function that computes its min-aggregated reward from the texts: the same samples (the same seed)
    get the same rewards, so the runs log the same figures."""
    oracle = tmp_path / "oracle.py"
    oracle.write_text(ORACLE.format(folder=str(prm_folder)))
    common = ["--config", "examples/tiny/grpo.yaml", f"actor.path={TINY_MODEL}", "rl.kl_coef=0",
              "rollout.prompts_per_step=8", "rollout.n_samples=4", "rollout.max_new_tokens=16",
              "train.batch_size=32", "train.max_steps=2", "log.eval_every_steps=0", "checkpoint.every_steps=0",
              "log.tensorboard=false", "log.progress=false"]
    hpc_rlhf_cli("grpo", *common, "placement=actor=1,reward=1,rollout@actor", f"reward.models=[{prm_folder}]",
                 "reward.functions=[]", "reward.process_aggregate=min", f"output_dir={tmp_path / 'prm'}")
    hpc_rlhf_cli("grpo", *common, "placement=actor=1,rollout@actor", "reward.models=[]",
                 f"reward.functions=[{oracle}:prm_min]", f"output_dir={tmp_path / 'by_hand'}")
    served, by_hand = read_metrics(tmp_path / "prm"), read_metrics(tmp_path / "by_hand")
    assert [r["step"] for r in served] == [1, 2]
    for ours, theirs in zip(served, by_hand):
        for key in ("reward", "reward_std", "response_length", "policy_loss"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), (key, ours, theirs)
    assert 0 < served[0]["reward"] < 1 and served[0]["reward_std"] > 0  # some responses had steps, not all alike
