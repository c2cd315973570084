"""Rejection sampling: the selection rule on hand-made records, and best-of-n fine-tuning from the session's SFT
model raising held-out exact match; a finished run restarted does not repeat its rounds."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, learning, record_figures


def rec(index, sample, score):
    return {"index": index, "sample": sample, "score": score, "prompt": f"p{index}", "response": f"r{sample}"}


RECORDS = [rec(0, 0, 0.2), rec(0, 1, 0.9), rec(0, 2, 0.9), rec(1, 0, -1.0), rec(1, 1, 0.5), rec(1, 2, 0.1)]


def keys(records):
    return [(r["index"], r["sample"]) for r in records]


def test_select_samples_by_hand():
    from hpc_rlhf.trainers.rejection import select_samples

    assert keys(select_samples(RECORDS, "best")) == [(0, 1), (1, 1)]  # a tie keeps the earlier sample
    assert keys(select_samples(RECORDS, "top_k", k=2)) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert keys(select_samples(RECORDS, "threshold", threshold=0.2)) == [(0, 1), (0, 2), (0, 0), (1, 1)]
    assert keys(select_samples(RECORDS, "best", min_score=0.6)) == [(0, 1)]
    with pytest.raises(ValueError, match="has no score"):
        select_samples([{"index": 3, "sample": 0}])


# One correct sample per prompt (select.strategy=best, min_score=1) of 768 prompts sampled at temperature 1: each
# prompt the model solves weighs the same. The earlier top_k=8 of 384 prompts at temperature 0.7 filled its data
# with 8 copies of each easy (no-carry) prompt while the carry prompts, where the base fails, gave a few samples,
# and from a weaker base (Intel Xeon, 0.580) it gained only 2 prompts of 300.
RS_SETTINGS = ["data.max_train_rows=768", "generate.n=8", "generate.chunk_size=64", "generate.max_new_tokens=5",
               "generate.temperature=1.0", "select.strategy=best", "select.min_score=1",
               "train.max_steps=80", "train.batch_size=32", "train.micro_batch_size=32", "train.lr=1e-3",
               "train.warmup_steps=5", "log.every_steps=40", "log.eval_every_steps=80",
               "eval.max_rows=300", "checkpoint.resume=true"]


@pytest.mark.learning
def test_rejection_sampling_beats_its_starting_model(world, tmp_path, sft_base):
    """The SFT model drops the carry in most carry problems; its correct samples carry, and fine-tuning on them
    teaches it to."""
    from hpc_rlhf.trainers import rejection

    out = tmp_path / "rs"
    cfg = load_config(rejection.Config, None,
                      [f"output_dir={out}", f"model.path={sft_base}", *QUIET, *learning(*RS_SETTINGS, sampling=True)])
    result = rejection.run(cfg)
    sft_rows = read_metrics(out / "round_1" / "sft")
    before, after = sft_rows[0]["eval_accuracy"], sft_rows[-1]["eval_accuracy"]
    record_figures("rs", before=before, after=after, gain=after - before, kept=result["kept"])
    print(f"rs: exact match {before:.3f} -> {after:.3f}; kept {result['kept']} samples of {result['prompts']} prompts; "
          f"mean sample score {result['mean_score']:.3f}, best-of-8 {result['best_of_n_score']:.3f}")
    # The 2-layer tiny Llama (2026-11-28, seeds 0-4 with their own bases, scripts/calibrate_learning_tests.py;
    # docs/results.md): 0.630, 0.580, 0.690, 0.643, 0.697 -> 0.903, 0.753, 0.880, 0.793, 0.957 (+0.150 to +0.273);
    # the control +0.000. The 4-layer model's figures:
    # Held-out exact match on 300 prompts (eval.max_rows), AMD EPYC, 2026-11-26, each run against its own base
    # (HPC_RLHF_TEST_SFT_BASE=<sft run>/final HPC_RLHF_TEST_SEED=N pytest tests/trainers/test_rejection.py -k beats,
    # or the same settings through `hpc-rlhf rs`). 1000-step bases (tests/recipes.py SFT_BASE), seeds 0-3: 0.620,
    # 0.707, 0.797, 0.693 -> 0.827, 0.863, 0.923, 0.913 (+0.207, +0.157, +0.127, +0.220; seed 4 not measured);
    # 700-step bases, seeds 0-1: 0.613, 0.687 -> 0.860, 0.897 (+0.247, +0.210); the lr=0 control +0.000 (0.620 and
    # 0.613 unchanged). The old recipe gained +0.177, +0.107, +0.120 (seeds 0-2) and +0.210 (700 steps, seed 0).
    # No base of these settings came out at 0.55-0.60 here (500-560 steps: under 0.10; 600: 0.720), so Intel's
    # 0.580 (CI's seed 0, where the old recipe gained 2 prompts of 300) is not emulated exactly. The bar, 12 prompts
    # of 300, is under a third of the lowest calibrated gain and far from the control.
    assert after >= before + 0.04, f"rs: held-out exact match {before:.3f} -> {after:.3f}"
    kept = [json.loads(line) for line in (out / "round_1" / "sft_data.jsonl").read_text().splitlines()]
    assert kept and all(r["score"] == 1.0 for r in kept)
    assert len(kept) == result["kept"] <= 768 and result["best_of_n_score"] > result["mean_score"]
    assert (out / "final" / "model.safetensors").is_file()
    assert read_metrics(out)[-1]["step"] == 1

    again = rejection.run(cfg)  # all rounds done: nothing is repeated
    assert again["complete"] and "kept" not in again
