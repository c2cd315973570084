"""The reward-model recipe: it learns to rank held-out pairs (the session's shared reward model), and final/ reloads
with the same scores and its normalisation constants. The two-rank ZeRO-3 run's worker code is at the bottom."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, Curve, record_figures


def rm_config(out, *overrides):
    from hpc_rlhf.trainers import rm

    return load_config(rm.Config, None, [f"output_dir={out}", *QUIET, "checkpoint.resume=false", *overrides])


# The session's reward model (tests/recipes.py) must rank held-out pairs at least this well: PPO rewarded
# by it alone (tests/rl/test_ppo.py) needs as much. Measured over seeds 0-4 on AMD machines 0.914-0.976 after
# 1000 steps (0.50 at step 0, 0.74-0.84 at step 500); on an Intel one 0.838-0.956 (seeds 0-2); with train.lr=0 it
# stays at chance.
# The 2-layer tiny Llama (2026-11-28, seeds 0-4; docs/results.md): 0.856-0.958 after 1,000 steps, 0.928-0.992 after
# 2,000 (what tests/recipes.py trains now); with train.lr=0 0.518. Scoring each pair in one row (rm.share_prompt,
# examples/tiny/rm.yaml; 2026-11-29, seeds 0-4): 0.962-0.976 after 2,000 steps.
RM_ACCURACY = 0.85


@pytest.mark.learning
def test_reward_model_ranks_held_out_pairs_and_final_reloads(world, tmp_path, ppo_reward_model):
    """The session's reward model (2,000 steps from the SFT base on the built-in correct-vs-wrong pairs, the one the
    PPO tests start from) learned to rank held-out pairs, and its final/ folder, loaded again as a plain
    token-classification model, scores them exactly as the trained model did, with the normalisation constants it
    stored."""
    from transformers import AutoModelForTokenClassification

    from hpc_rlhf.data.examples import pair_collate
    from hpc_rlhf.models.value_model import reward_normalization, sequence_scores
    from hpc_rlhf.trainers import rm

    run = Curve(ppo_reward_model.parent)
    first, last, losses = run.start, run.end, run.values("loss")
    record_figures("rm_ranks_pairs", accuracy_start=first["eval_accuracy"], accuracy=last["eval_accuracy"],
                   margin=last["eval_margin"], loss_first=losses[0], loss_last=losses[-1])
    assert first["step"] == 0 and 0.35 < first["eval_accuracy"] < 0.65  # a new head ranks pairs by chance
    assert last["eval_accuracy"] >= RM_ACCURACY and last["eval_margin"] > 0.05, last
    assert losses[-1] < losses[0]

    # final/ on the same held-out pairs: the last evaluation's figures, bit for bit, and the stored constants are
    # those of its scores.
    trained_with = load_config(rm.Config, ppo_reward_model.parent / "config.yaml", [])
    recipe = rm.RewardModelRecipe(rm_config(tmp_path / "reloaded", f"model.path={ppo_reward_model}",
                                            f"data.eval_files=[{','.join(trained_with.data.eval_files)}]",
                                            f"data.max_eval_rows={trained_with.data.max_eval_rows}",
                                            f"rm.share_prompt={trained_with.rm.share_prompt}"))
    recipe.setup()
    assert recipe.evaluate() == {k: last[k] for k in ("eval_accuracy", "eval_margin", "eval_loss")}
    loaded = AutoModelForTokenClassification.from_pretrained(ppo_reward_model)
    mean, std = reward_normalization(loaded)
    assert (mean, std) == (pytest.approx(recipe.normalization_constants()[0]),
                           pytest.approx(recipe.normalization_constants()[1]))
    assert std > 0 and (mean, std) != (0.0, 1.0)
    batch = pair_collate(recipe.eval_examples[:16], recipe.tokenizer.pad_token_id)
    with torch.no_grad():
        raw = sequence_scores(loaded, batch["input_ids"], batch["attention_mask"])
        normalized = sequence_scores(loaded, batch["input_ids"], batch["attention_mask"], normalize=True)
    torch.testing.assert_close(normalized, (raw - mean) / std)


def test_margin_key_enters_the_loss(world, tmp_path):
    from hpc_rlhf.trainers import rm

    pairs = tmp_path / "margins.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 11),
                                         "margin": float(a % 3)}) + "\n" for a in range(8)))
    recipe = rm.RewardModelRecipe(rm_config(tmp_path / "margin", "rm.margin_key=margin", f"data.train_files=[{pairs}]",
                                            "data.eval_files=[]", "train.batch_size=8", "train.micro_batch_size=8"))
    recipe.setup()
    pairs_in = recipe.train_examples
    assert [p["margin"] for p in pairs_in] == [float(a % 3) for a in range(8)]
    with torch.no_grad():
        chosen, rejected, _ = recipe._pair_scores(pairs_in)
        loss, accuracy, difference, _ = recipe._loss(pairs_in)
    margins = torch.tensor([a % 3 for a in range(8)], dtype=torch.float32)
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(chosen - rejected - margins).mean())
    assert loss.item() > -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    torch.testing.assert_close(difference, (chosen - rejected).mean())


def test_shared_prompt_rows_give_the_scores_and_gradients_of_pair_rows(world, tmp_path):
    """rm.share_prompt scores each pair in one row that holds its prompt once: the chosen and rejected scores, the
    loss and every gradient are those of the 2B separate rows (float32, sums in another order), with prompts and
    responses of different lengths, the rejected side longer or shorter than the chosen one. A mask that let the
    rejected response see the chosen one, or positions that did not restart after the prompt, fail it."""
    from hpc_rlhf.trainers import rm

    pairs = tmp_path / "pairs.jsonl"
    rows = [("1+1=", "2", "12"), ("35+467=", "502", "492"), ("8+80=", "88", "8"), ("123+4=", "127", "1270")]
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    results = {}
    for share in (False, True):
        torch.manual_seed(0)
        recipe = rm.RewardModelRecipe(rm_config(tmp_path / str(share), f"rm.share_prompt={share}",
                                                f"data.train_files=[{pairs}]", "data.eval_files=[]",
                                                "train.batch_size=4", "train.micro_batch_size=4"))
        recipe.setup()
        model = recipe.engine.module
        model.zero_grad()
        chosen, rejected, tokens = recipe._pair_scores(recipe.train_examples)
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        recipe.engine.backward(loss)
        results[share] = (chosen.detach(), rejected.detach(), loss.detach(), tokens,
                          {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    plain, shared = results[False], results[True]
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[2], plain[2], rtol=1e-5, atol=1e-6)
    assert shared[4].keys() == plain[4].keys() and len(plain[4]) > 5
    for name, grad in plain[4].items():
        torch.testing.assert_close(shared[4][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    prompt_tokens = sum(example["prompt_len"] for example in recipe.train_examples)
    assert shared[3] == plain[3] - prompt_tokens  # the prompts once


def test_shared_prompt_with_flash_attention_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="rm.share_prompt=true needs a 4D attention mask.*flash_attention_2"):
        rm_config(tmp_path, "rm.share_prompt=true", "model.attn_implementation=flash_attention_2")


def test_bad_margin_and_bad_key_are_named(world, tmp_path, capfd):
    from hpc_rlhf.cli import main

    with pytest.raises(ConfigError, match="rm.margin_key is empty"):
        rm_config(tmp_path, "rm.margin_key=' '")
    assert main(["rm", "rm.margin=1.0"]) == 2
    assert "did you mean 'rm.margin_key'" in capfd.readouterr().err

    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "12", "margin": "big"}) + "\n")
    assert main(["rm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]", "rm.margin_key=margin",
                 *QUIET]) != 0
    assert f"{bad}, line 1: key 'margin' must be float, got str" in capfd.readouterr().err


def test_pairs_grouped_by_length_train_as_one_micro_batch_does(world, tmp_path):
    """train.group_by_length cuts a step's pairs sorted by their longer side: a mean over the step's pairs, so the
    same loss and gradient as the whole step in one micro-batch (RM's loss is a mean over rows)."""
    from hpc_rlhf.trainers import rm

    settings = ["train.max_steps=1", "train.batch_size=8", "train.warmup_steps=0", "log.every_steps=1",
                "log.eval_every_steps=0", "data.max_train_rows=64", "data.max_eval_rows=8"]
    figures = {}
    for name, extra in (("one", ["train.micro_batch_size=8"]),
                        ("grouped", ["train.micro_batch_size=2", "train.group_by_length=true"])):
        rm.run(rm_config(tmp_path / name, *settings, *extra))
        figures[name] = read_metrics(tmp_path / name)[-1]
    assert figures["grouped"]["loss"] == pytest.approx(figures["one"]["loss"], rel=1e-5)
    assert figures["grouped"]["grad_norm"] == pytest.approx(figures["one"]["grad_norm"], rel=1e-4)


def test_two_ranks_zero3(tmp_path):
    from transformers import AutoModelForTokenClassification

    from tests.distributed import run_ranks

    run_ranks(2, __file__, "zero3", str(tmp_path / "rm"), timeout=240)
    rows = read_metrics(tmp_path / "rm")
    assert rows[-1]["step"] == 4 and "eval_accuracy" in rows[-1]
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm" / "final")
    assert loaded.config.num_labels == 1 and loaded.config.reward_std > 0


if __name__ == "__main__":
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.trainers import rm

    case, out = sys.argv[1], sys.argv[2]
    assert case == "zero3"
    init_distributed("gloo", 120, expected_world_size=2)
    rm.run(load_config(rm.Config, None, [
        f"output_dir={out}", *QUIET, "train.zero_stage=3", "train.zero3_param_persistence_threshold=0",
        "train.max_steps=4", "train.batch_size=8", "train.micro_batch_size=4", "log.every_steps=2",
        "log.eval_every_steps=4", "data.max_train_rows=64", "data.max_eval_rows=9", "rm.share_prompt=true"]))
    dist.barrier()
    dist.destroy_process_group()
