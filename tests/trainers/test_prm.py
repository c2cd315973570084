"""The process reward model recipe: it learns to call wrong steps wrong on held-out solutions, final/ reloads as a
causal LM that scores the steps as the trained model did, and bad step data is named by file and line."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_rlhf.config import ConfigError, load_config
from tests.recipes import QUIET, Curve, learning, record_figures


def prm_config(out, *overrides):
    from hpc_rlhf.trainers import prm

    return load_config(prm.Config, None, [f"output_dir={out}", *QUIET, "checkpoint.resume=false", *overrides])


# From the SFT base, which can add but has never judged a step: at step 0 its calls are near chance on the right and
# the wrong steps apart (69% of the held-out steps are right). Calibrated over seeds 0-4, each on its own SFT base
# (Intel Xeon 2-core VM, 2026-11-30; docs/results.md), 150 steps: step accuracy 0.516-0.683 -> 0.780-0.881 (gains
# +0.174 to +0.304), wrong steps found 0.428-0.659, right steps 0.928-0.979; with train.lr=0 (seed 0) nothing moves
# (0.683, wrong steps 0.058). Not calibrated on AMD.
PRM_SETTINGS = ("train.max_steps=150", "train.batch_size=128", "train.micro_batch_size=128", "train.lr=2e-3",
                "train.warmup_steps=20", "log.every_steps=50", "log.eval_every_steps=150", "data.max_eval_rows=300")
STEP_ACCURACY_GAIN = 0.1
STEP_ACCURACY = 0.74  # above the 0.69 of a judge that calls every step right
WRONG_STEP_ACCURACY = 0.3


@pytest.mark.learning
def test_process_reward_model_learns_to_find_wrong_steps_and_final_reloads(world, tmp_path, sft_base):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.data.examples import pad_collate
    from hpc_rlhf.trainers import prm

    out = tmp_path / "prm"
    prm.run(prm_config(out, f"model.path={sft_base}", *learning(*PRM_SETTINGS)))
    run = Curve(out)
    start, end = run.start, run.end
    record_figures("prm", step_accuracy_start=start["eval_step_accuracy"], step_accuracy=end["eval_step_accuracy"],
                   right_step_accuracy_start=start["eval_right_step_accuracy"],
                   right_step_accuracy=end["eval_right_step_accuracy"],
                   wrong_step_accuracy_start=start["eval_wrong_step_accuracy"],
                   wrong_step_accuracy=end["eval_wrong_step_accuracy"], loss_first=run.values("loss")[0],
                   loss_last=end["loss"])
    assert start["step"] == 0
    assert end["eval_step_accuracy"] >= start["eval_step_accuracy"] + STEP_ACCURACY_GAIN, (start, end)
    assert end["eval_step_accuracy"] >= STEP_ACCURACY and end["eval_wrong_step_accuracy"] >= WRONG_STEP_ACCURACY, end

    # final/ is a causal LM that records its marker and reward tokens, and scores the held-out steps as the
    # trained model did: the last evaluation again (the loss to float64 rounding: 4e-11 apart at seed 0).
    final = out / "final"
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.process_reward == {"placeholder_token": "#", "reward_tokens": ["+", "-"]}
    recipe = prm.ProcessRewardRecipe(prm_config(tmp_path / "reloaded", f"model.path={final}",
                                                "data.max_eval_rows=300"))
    recipe.setup()
    assert recipe.evaluate() == pytest.approx(
        {k: end[k] for k in ("eval_step_accuracy", "eval_loss", "eval_right_step_accuracy",
                                     "eval_wrong_step_accuracy")}, rel=1e-9, abs=0)
    examples = recipe.eval_examples[:8]
    batch = pad_collate([{"input_ids": e["input_ids"]} for e in examples], recipe.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scores = prm.step_scores(logits, [e["marker_positions"] for e in examples], recipe.reward_ids)
    torch.testing.assert_close(scores, recipe._marker_logits(examples)[0])


def test_step_scores_are_the_reward_tokens_logits_at_each_marker_in_row_order():
    from hpc_rlhf.trainers.prm import step_scores

    logits = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)  # value = 20 b + 5 t + v
    scores = step_scores(logits, [[1, 3], [2]], reward_ids=[4, 0])
    assert scores.tolist() == [[9.0, 5.0], [19.0, 15.0], [34.0, 30.0]]


def test_a_micro_batch_loss_is_over_its_markers_and_weighs_each_marker_alike(world, tmp_path):
    from hpc_rlhf.algorithms.losses import process_reward_loss
    from hpc_rlhf.trainers import prm

    recipe = prm.ProcessRewardRecipe(prm_config(tmp_path / "run", "data.max_train_rows=8", "data.eval_files=[]"))
    recipe.setup()
    micro = recipe._micro_batch([0, 1, 2])
    markers = recipe._markers([0, 1, 2])
    assert micro.loss_tokens == markers == 9  # three steps in each built-in solution
    marker_logits, targets, tokens = recipe._marker_logits([recipe.train_examples[i] for i in (0, 1, 2)])
    assert targets.shape == (9, 2) and micro.tokens == tokens
    torch.testing.assert_close(micro.loss, process_reward_loss(marker_logits, targets)[0])


def test_bad_step_data_and_tokens_are_named(world, tmp_path, capfd):
    from hpc_rlhf.data.examples import single_token_id
    from hpc_rlhf.data.loading import DataError
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.trainers import prm

    rows = tmp_path / "steps.jsonl"
    rows.write_text(json.dumps({"input": "1+2=1+2=3#0+0=0#3#", "label": ["+", "+", "+"]}) + "\n" +
                    json.dumps({"input": "1+3=1+3=4#0+0=0#4#", "label": ["+", "+"]}) + "\n")
    recipe = prm.ProcessRewardRecipe(prm_config(tmp_path / "a", f"data.train_files=[{rows}]", "data.eval_files=[]"))
    with pytest.raises(ValueError, match=r"steps\.jsonl, line 2: 2 labels for 3 step markers"):
        recipe.setup()

    rows.write_text(json.dumps({"input": "1+2=1+2=3#", "label": ["ok"]}) + "\n")
    recipe = prm.ProcessRewardRecipe(prm_config(tmp_path / "b", f"data.train_files=[{rows}]", "data.eval_files=[]"))
    with pytest.raises(ValueError, match=r"line 1: step label 'ok' is none of the reward tokens \['\+', '-'\]"):
        recipe.setup()

    # Skipping: the rows whose labels do not fit are counted and left out; none left is still an error.
    rows.write_text(json.dumps({"input": "1+2=1+2=3#0+0=0#3#", "label": ["+", "+", "+"]}) + "\n" +
                    json.dumps({"input": "1+3=1+3=4#0+0=0#4#", "label": ["+", "+"]}) + "\n" +
                    json.dumps({"input": "1+3=1+3=4#", "label": ["?"]}) + "\n")
    cfg = prm_config(tmp_path / "s", f"data.train_files=[{rows}]", "data.on_bad_row=skip")
    tokenizer = load_tokenizer(cfg.model.path)
    marker = single_token_id(tokenizer, "#", "prm.placeholder_token")
    load = dict(data=cfg.data, tokenizer=tokenizer, marker_id=marker, reward_tokens=["+", "-"], max_rows=None)
    capfd.readouterr()
    examples = prm.load_process_examples([rows], where="data.train_files", **load)
    assert [len(example["marker_positions"]) for example in examples] == [3]
    assert "data.train_files: skipped 2 of 3 rows (bad_label: 2); first: " in capfd.readouterr().err
    rows.write_text(json.dumps({"input": "1+3=1+3=4#", "label": ["?"]}) + "\n")
    with pytest.raises(DataError, match=r"data.train_files: every row is bad .*none of the reward tokens"):
        prm.load_process_examples([rows], where="data.train_files", **load)

    recipe = prm.ProcessRewardRecipe(prm_config(tmp_path / "c", "prm.placeholder_token=ки", "data.eval_files=[]"))
    with pytest.raises(ValueError, match="prm.placeholder_token='ки' is 2 tokens"):
        recipe.setup()

    with pytest.raises(ConfigError, match="also one of prm.reward_tokens"):
        prm_config(tmp_path / "d", "prm.placeholder_token=+")
