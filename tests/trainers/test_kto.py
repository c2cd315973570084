"""The KTO recipe: mismatched pairs for the KL reference point, learning on labelled answers, the CLI's messages.
The two-rank run (ZeRO-2, precomputed reference) goes through torchrun (worker code at the bottom)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.trainers.kto import kl_partners, mismatched_example
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, Curve, learning, record_figures


def kto_config(out, *overrides):
    from hpc_rlhf.trainers import kto

    return load_config(kto.Config, None, [f"output_dir={out}", *QUIET, "checkpoint.resume=false", *overrides])


def test_kl_partners_pair_every_row_with_another_row_once():
    for n in (2, 3, 10, 101):
        partners = kl_partners(n, seed=7)
        assert sorted(partners) == list(range(n))  # every completion is used once
        assert all(partner != row for row, partner in enumerate(partners))
        # One cycle through all rows: following partners from row 0 visits every row before coming back.
        seen, row = set(), 0
        while row not in seen:
            seen.add(row)
            row = partners[row]
        assert len(seen) == n
    assert kl_partners(50, seed=1) == kl_partners(50, seed=1) != kl_partners(50, seed=2)
    with pytest.raises(ValueError, match="at least 2 rows"):
        kl_partners(1, seed=0)


def test_mismatched_example_joins_one_prompt_with_another_completion():
    a = {"input_ids": [1, 10, 11, 12, 50, 2], "labels": [-100, -100, -100, -100, 50, 2], "prompt_len": 4}
    b = {"input_ids": [1, 20, 60, 61, 2], "labels": [-100, -100, 60, 61, 2], "prompt_len": 2}
    joined = mismatched_example(a, b, max_len=16)
    assert joined == {"input_ids": [1, 10, 11, 12, 60, 61, 2], "labels": [-100, -100, -100, -100, 60, 61, 2],
                      "prompt_len": 4}
    cut = mismatched_example(a, b, max_len=6)
    assert cut["input_ids"] == [1, 10, 11, 12, 60, 61] and cut["labels"][-1] == 61


def test_kto_config_reads_completions_by_default():
    from hpc_rlhf.trainers import kto

    cfg = load_config(kto.Config, None, ["data.max_len=48"])  # overriding one data key keeps the others
    assert cfg.data.response_key == "completion" and cfg.data.train_files[0].endswith("kto_train.jsonl")


def test_a_label_other_than_true_or_false_stops_the_run_or_is_skipped(tmp_path, caplog):
    from hpc_rlhf.data.loading import DataError
    from hpc_rlhf.models.builders import load_tokenizer
    from hpc_rlhf.trainers import kto

    rows = tmp_path / "kto.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": "1+1=", "completion": "2", "label": label})
                              for label in (True, 2, 0)) + "\n")
    cfg = load_config(kto.Config, None, [])
    tokenizer = load_tokenizer(cfg.model.path)
    with pytest.raises(ValueError, match=r"kto\.jsonl, line 2: a KTO label must be true/false \(or 1/0\), got 2"):
        kto.load_kto_examples([rows], cfg.data, tokenizer, "data.train_files", None)
    cfg = load_config(kto.Config, None, ["data.on_bad_row=skip"])
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.data.loading"):
        examples = kto.load_kto_examples([rows], cfg.data, tokenizer, "data.train_files", None)
    assert [example["label"] for example in examples] == [True, False]
    assert any("data.train_files: skipped 1 of 3 rows (bad_label: 1)" in r.getMessage() for r in caplog.records)
    rows.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": 7}) + "\n")
    with pytest.raises(DataError, match="data.train_files: every row is bad"):
        kto.load_kto_examples([rows], cfg.data, tokenizer, "data.train_files", None)


@pytest.mark.learning
def test_kto_loss_falls_and_held_out_reward_gap_opens(world, tmp_path, sft_base):
    from hpc_rlhf.trainers import kto

    out = tmp_path / "kto"
    kto.run(kto_config(out, f"model.path={sft_base}",
                       *learning("train.max_steps=80", "train.batch_size=32", "train.micro_batch_size=32",
                                 "train.lr=1e-4", "train.warmup_steps=5", "log.every_steps=20",
                                 "log.eval_every_steps=80", "data.max_eval_rows=256", "eval.prompt_files=[]")))
    run = Curve(out)
    rows, start, end = run.rows, run.start, run.end
    record_figures("kto", eval_reward_gap=end["eval_reward_gap"], eval_desirable=end["eval_desirable_reward"],
                   eval_undesirable=end["eval_undesirable_reward"], loss_first=rows[1]["loss"], loss_last=end["loss"],
                   desirable=end["desirable_reward"], undesirable=end["undesirable_reward"])
    # Policy = reference at the start: every implied reward is 0, and the loss of every row is 1 - sigmoid(0).
    assert start["eval_reward_gap"] == 0.0
    # The 2-layer tiny Llama (2026-11-28, seeds 0-4; docs/results.md): gap 0.113-0.174, training loss
    # 0.494-0.496 -> 0.477-0.491. The 4-layer model's figures:
    # Calibrated over seeds 0-4: gap 0.122-0.175 after 80 steps, training loss 0.489-0.498 -> 0.476-0.488
    # (train.lr=0: gap 0, loss 0.5 throughout).
    assert end["eval_reward_gap"] > 0.05
    assert end["eval_desirable_reward"] > end["eval_undesirable_reward"]
    assert end["loss"] < 0.495 and end["loss"] < rows[1]["loss"]
    assert end["desirable_reward"] > end["undesirable_reward"]
    assert all(r["kl"] >= 0 for r in rows[1:])


def test_two_ranks_zero2_with_a_precomputed_reference(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(2, __file__, "zero2-precompute", str(tmp_path / "kto"), timeout=240)
    rows = read_metrics(tmp_path / "kto")
    assert rows[-1]["step"] == 4 and "eval_reward_gap" in rows[-1] and "eval_exact_match" in rows[-1]
    assert (tmp_path / "kto" / "final" / "model.safetensors").is_file()


if __name__ == "__main__":
    import torch.distributed as dist

    from hpc_rlhf.dist.bootstrap import init_distributed
    from hpc_rlhf.trainers import kto

    case, out = sys.argv[1], sys.argv[2]
    assert case == "zero2-precompute"
    init_distributed("gloo", 120, expected_world_size=2)
    kto.run(load_config(kto.Config, None, [
        f"output_dir={out}", *QUIET, "train.zero_stage=2", "ref.mode=precompute", "train.max_steps=4",
        "train.batch_size=8", "train.micro_batch_size=4", "log.every_steps=2", "log.eval_every_steps=4",
        "data.max_train_rows=33", "data.max_eval_rows=9", "eval.max_rows=6"]))
    dist.barrier()
    dist.destroy_process_group()


def test_grouping_rows_by_length_is_refused_for_it_would_change_the_reference_point():
    from hpc_rlhf.trainers import kto

    with pytest.raises(ConfigError, match="train.group_by_length would change KTO's loss"):
        load_config(kto.Config, None, ["train.group_by_length=true"])
