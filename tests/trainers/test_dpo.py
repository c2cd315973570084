"""The DPO recipe (sigmoid, IPO, cDPO) and the reference log-probs it compares with (runtime/reference.py).

Learning runs start from the session's SFT model (tests/recipes.py), as DPO does in practice. The
two-rank run (ZeRO-3, with the colocated reference sharded too) goes through torchrun; its worker code is at the
bottom of this file.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.runtime.reference import balanced_chunks, response_logps
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, Curve, learning, record_figures


def dpo_config(out, *overrides):
    from hpc_rlhf.trainers import dpo

    return load_config(dpo.Config, None, [f"output_dir={out}", *QUIET, "checkpoint.resume=false", *overrides])


# ------------------------------------------------------------------------------------------------ pure maths
def test_response_logps_sums_and_averages_the_label_tokens():
    # Row 0 scores tokens 1 and 2 (labels at positions 1, 2); row 1 only token 2. Position t predicts t + 1.
    logits = torch.zeros(2, 3, 2)
    logits[:, 0] = torch.tensor([0.0, math.log(3.0)])  # p(1) = 3/4 after position 0
    logits[:, 1] = torch.tensor([math.log(4.0), 0.0])  # p(0) = 4/5 after position 1
    labels = torch.tensor([[-100, 1, 0], [-100, -100, 0]])
    got = response_logps(logits, labels)
    row0 = math.log(3 / 4) + math.log(4 / 5)
    expected = torch.tensor([[row0, row0 / 2], [math.log(4 / 5), math.log(4 / 5)]])
    torch.testing.assert_close(got, expected)


def test_balanced_chunks_give_every_rank_the_same_number_of_passes():
    assert balanced_chunks(5, 0, 2, 2) == [[0, 2], [4]]
    assert balanced_chunks(5, 1, 2, 2) == [[1, 3], []]  # the empty chunk is a dummy pass
    assert balanced_chunks(4, 1, 2, 8) == [[1, 3]]
    assert balanced_chunks(0, 0, 2, 4) == []
    every = sorted(i for rank in range(3) for chunk in balanced_chunks(10, rank, 3, 2) for i in chunk)
    assert every == list(range(10))


def test_dpo_config_checks_relations_between_keys():
    from hpc_rlhf.trainers import dpo

    with pytest.raises(ConfigError, match="sigmoid only"):
        load_config(dpo.Config, None, ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="below 0.5"):
        load_config(dpo.Config, None, ["dpo.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="ref.mode"):
        load_config(dpo.Config, None, ["ref.mode=shared"])


# ------------------------------------------------------------------------------------------------ recipe
def test_precomputed_and_colocated_reference_give_the_same_first_loss(world, tmp_path):
    from hpc_rlhf.algorithms.losses import sft_loss
    from hpc_rlhf.trainers import dpo
    from hpc_rlhf.data import order

    small = ["data.max_train_rows=24", "data.max_eval_rows=8", "eval.prompt_files=[]", "train.batch_size=8",
             "train.micro_batch_size=8", "dpo.beta=0.5"]
    losses, recipes = {}, {}
    for mode in ("colocated", "precompute"):
        recipe = dpo.DPORecipe(dpo_config(tmp_path / mode, f"ref.mode={mode}", *small))
        recipe.setup()
        micro = order.step_indices(len(recipe.train_examples), 8, 0, 0)
        # Perturb the policy so that the reference matters (at step 0 the two are the same model).
        with torch.no_grad():
            for p in recipe.engine.module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        losses[mode] = recipe._pair_loss("train", micro, recipe.train_examples)["loss"].item()
        recipes[mode] = (recipe, micro)
    assert recipes["precompute"][0].reference.model is None  # freed after the pass
    assert losses["colocated"] != pytest.approx(math.log(2), abs=1e-3)
    assert losses["precompute"] == pytest.approx(losses["colocated"], abs=1e-5)

    # dpo.sft_weight adds that multiple of the chosen answers' NLL.
    recipe, micro = recipes["colocated"]
    recipe.cfg.dpo.sft_weight = 0.5
    with torch.no_grad():
        with_nll = recipe._pair_loss("train", micro, recipe.train_examples)["loss"].item()
        batch = recipe._collate([recipe.train_examples[i] for i in micro])
        logits = recipe.engine(input_ids=batch["input_ids"][:8], attention_mask=batch["attention_mask"][:8]).logits
        nll = sft_loss(logits[:, :-1], batch["labels"][:8, 1:]).item()
    assert with_nll == pytest.approx(losses["colocated"] + 0.5 * nll, rel=1e-5)


@pytest.mark.learning
def test_dpo_raises_held_out_preference_accuracy_and_margin(world, tmp_path, sft_base):
    from hpc_rlhf.trainers import dpo

    out = tmp_path / "dpo"
    dpo.run(dpo_config(out, f"model.path={sft_base}",
                       *learning("train.max_steps=80", "train.batch_size=32", "train.micro_batch_size=32",
                                 "train.lr=5e-4", "train.warmup_steps=5", "log.every_steps=20",
                                 "log.eval_every_steps=80", "data.max_eval_rows=256", "eval.prompt_files=[]")))
    run = Curve(out)
    start, end = run.start, run.end
    record_figures("dpo", accuracy=end["eval_accuracy"], margin=end["eval_margin"], eval_loss=end["eval_loss"],
                   loss_last=end["loss"])
    # The policy starts as the reference: every implied reward is 0, so no pair is ranked right yet.
    assert start["eval_accuracy"] == 0.0 and start["eval_margin"] == 0.0
    assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # The 2-layer tiny Llama (2026-11-28, seeds 0-4; docs/results.md): accuracy 0.707-0.805, margin 0.211-0.408.
    # Chance is 0.5 +- 0.03 on 256 pairs. Measured after 80 steps from the session's SFT base at seeds 0-4:
    # accuracy 0.742-0.828, margin 0.309-0.381 (with train.lr=0: 0 and 0). At lr 1e-3 seed 4 diverged early
    # (training loss 0.82 at step 20, accuracy 0.551 at the end). From the weak warm-start model DPO stayed at
    # chance on pairs that probe both digits.
    assert end["eval_accuracy"] > 0.65 and end["eval_margin"] > 0.15
    assert end["eval_loss"] < start["eval_loss"]
    assert end["loss"] < math.log(2) and end["chosen_reward"] > end["rejected_reward"]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.learning
@pytest.mark.parametrize("variant, first_loss", [(["dpo.loss_type=ipo"], 25.0),
                                                 (["dpo.label_smoothing=0.2", "ref.mode=precompute"], math.log(2))],
                         ids=["ipo", "cdpo-precompute"])
def test_ipo_and_cdpo_losses_fall(world, tmp_path, sft_base, variant, first_loss):
    from hpc_rlhf.trainers import dpo

    out = tmp_path / "run"
    dpo.run(dpo_config(out, f"model.path={sft_base}", *variant,
                       *learning("train.max_steps=60", "train.batch_size=32", "train.micro_batch_size=32",
                                 "train.lr=1e-3", "train.warmup_steps=3", "log.every_steps=10",
                                 "log.eval_every_steps=0", "data.max_train_rows=96", "data.max_eval_rows=32",
                                 "eval.prompt_files=[]")))
    rows = [r for r in read_metrics(out) if "loss" in r]
    record_figures(f"dpo_loss_falls[{variant[0]}]", loss_first=rows[0]["loss"], loss_last=rows[-1]["loss"],
                   ratio_to_start=rows[-1]["loss"] / first_loss, margin=rows[-1]["margin"])
    # At step 0 the policy is the reference (h = 0): IPO's loss is (1 / (2 beta))^2 = 25 for beta 0.1 and cDPO's
    # is log 2 whatever the smoothing; the mean over the last 10 steps must be below it. The 96 training pairs
    # come round every 3 steps: this checks that each loss is optimised (on fresh batches IPO's target of 5 nats
    # per token moves its training loss little in 60 steps). Calibrated over seeds 0-4: the last loss is 0.14-0.25
    # of the first for IPO and 0.74-0.78 of log 2 for cDPO; 1.0 for both with train.lr=0.
    # The 2-layer tiny Llama (2026-11-28): 0.080-0.116 of the first for IPO, 0.735-0.749 of log 2 for cDPO.
    assert rows[-1]["loss"] < 0.9 * first_loss
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["margin"] > 0


def test_two_ranks_zero3_with_a_sharded_reference(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(2, __file__, "zero3", str(tmp_path / "dpo"), timeout=240)
    rows = read_metrics(tmp_path / "dpo")
    assert rows[-1]["step"] == 4 and "eval_exact_match" in rows[-1] and "eval_accuracy" in rows[-1]
    assert (tmp_path / "dpo" / "final" / "model.safetensors").is_file()


if __name__ == "__main__":
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.trainers import dpo

    case, out = sys.argv[1], sys.argv[2]
    assert case == "zero3"
    init_distributed("gloo", 120, expected_world_size=2)
    # 9 held-out pairs in chunks of 4: rank 0 scores 4 + 1, rank 1 scores 4 and then runs a dummy pass, because
    # under ZeRO-3 every forward pass gathers parameters with the other rank.
    dpo.run(load_config(dpo.Config, None, [
        f"output_dir={out}", *QUIET, "train.zero_stage=3", "train.zero3_param_persistence_threshold=0",
        "train.max_steps=4", "train.batch_size=8", "train.micro_batch_size=4", "log.every_steps=2",
        "log.eval_every_steps=4", "data.max_train_rows=64", "data.max_eval_rows=9", "eval.max_rows=6"]))
    dist.barrier()
    dist.destroy_process_group()


def test_grouping_rows_by_length_is_refused_with_the_nll_term_it_would_change():
    """DPO's loss is a mean over the step's pairs (grouping keeps it); the NLL term is a mean over each
    micro-batch's chosen tokens (grouping would weigh short answers more): both modes name both keys."""
    from hpc_rlhf.trainers import dpo, iterative_dpo

    load_config(dpo.Config, None, ["train.group_by_length=true"])  # no NLL term: allowed
    for config_class, extra in ((dpo.Config, ["dpo.sft_weight=0.5"]), (iterative_dpo.Config, [])):
        with pytest.raises(ConfigError, match="train.group_by_length with dpo.sft_weight=.*set dpo.sft_weight=0"):
            load_config(config_class, None, ["train.group_by_length=true", *extra])
