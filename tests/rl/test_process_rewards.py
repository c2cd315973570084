"""A process reward model on an RL reward role (hpc_rlhf/rl/scoring.py, runtime/process_rewards.py) gives a run the
same rewards as the same computation written by hand as a rule function."""

from __future__ import annotations

import pytest

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.utils.metrics import read_metrics
from tests.distributed import hpc_rlhf_cli
from tests.runtime.test_process_rewards import make_prm_folder

TINY_MODEL = f"{TINY_ASSETS}/models/llama-tiny"


def test_only_the_markers_the_policy_generated_are_steps(tmp_path):
    """The third sample is an episode whose "obs#" an environment wrote (a hole in its action mask): its steps are
    the policy's markers alone, as if the observation's were not there."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.rl.batches import make_batch
    from hpc_rlhf.rl.scoring import process_scores_of
    from hpc_rlhf.runtime.process_rewards import process_reward_spec, process_rewards

    folder = make_prm_folder(tmp_path / "prm")
    tokenizer = load_tokenizer(folder, pad_to_eos=True)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    spec = process_reward_spec(folder, tokenizer, "reward.models[0]")

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts = [ids("1#2="), ids("3+4="), ids("5=")]
    responses = [torch.tensor(ids("3#9#")), torch.tensor(ids("7")), torch.tensor(ids("6#obs#8#"))]
    masks = [torch.ones(4), torch.ones(1), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id, masks=masks)
    steps = torch.zeros_like(batch.input_ids, dtype=torch.bool)  # where the policy's markers are, by hand
    for row, columns in enumerate([[5, 7], [], [3, 9]]):
        assert all(batch.input_ids[row, j] == spec.marker_id for j in columns)
        steps[row, columns] = True
    with torch.no_grad():
        got = torch.cat(process_scores_of(model, spec, "mean")(batch))
        expected = process_rewards(model, batch.input_ids, batch.attention_mask, steps, spec, "mean")
        with_observation = process_rewards(model, batch.input_ids, batch.attention_mask, batch.input_ids > -1, spec,
                                           "mean")
    assert got.tolist() == expected.tolist() and got[1] == 0.0
    assert with_observation[2] != got[2]  # the observation's marker would have counted


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


def test_an_rl_run_scores_with_it_as_the_same_computation_by_hand_does(tmp_path):
    """Two GRPO steps of the tiny model with the process reward model on a reward role, against the same steps
    with a rule function that computes its min-aggregated reward from the texts: the same samples (the same seed)
    get the same rewards, so the runs log the same figures."""
    prm_folder = make_prm_folder(tmp_path / "prm_model")
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
