"""Conditional SFT: buckets and prompts by hand, bad settings named, and a model trained on score-labelled samples
answers better when asked for the highest score than when asked for the lowest."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.config import TINY_ASSETS, ConfigError, load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, learning, record_figures

DATA = f"{TINY_ASSETS}/data"


def test_buckets_and_prompts_by_hand():
    from hpc_rlhf.trainers.conditional import conditional_rows, score_bucket

    assert [score_bucket(s, [0.5, 2.0]) for s in (-1.0, 0.4, 0.5, 1.9, 2.0, 7.0)] == [0, 0, 1, 1, 2, 2]
    assert score_bucket(0.0, []) == 0
    rows = conditional_rows([{"prompt": "1+2=", "response": "3", "score": 1.0},
                             {"prompt": "1+2=", "response": "4", "score": 0.0}], "<score:{score}> {prompt}", [0.5])
    assert rows == [{"prompt": "<score:1> 1+2=", "response": "3", "score": 1.0},
                    {"prompt": "<score:0> 1+2=", "response": "4", "score": 0.0}]


@pytest.mark.parametrize("override, message", [("csft.template='{prompt} only'", "must contain {score}"),
                                               ("csft.bucket_edges=[1.0,0.5]", "strictly ascending"),
                                               ("csft.ask_bucket=3", "only buckets 0..1")])
def test_bad_settings_are_named(override, message):
    from hpc_rlhf.trainers import conditional

    with pytest.raises(ConfigError, match=message):
        load_config(conditional.Config, None, [override])


REWARD_FILE = """
def correct_sum(prompts, responses, answers):
    # the demonstrations have no answer column: the prompt "a+b=" says what is right
    sums = [str(int(a) + int(b)) for a, b in (p.rstrip("=").split("+") for p in prompts)]
    return [1.0 if r.replace("<eos>", "").strip() == s else 0.0 for r, s in zip(responses, sums)]
"""

CSFT_SETTINGS = [f"csft.response_files=[{DATA}/sft_train.jsonl]", "data.max_train_rows=4000", "train.max_steps=150",
                 "train.batch_size=128", "train.micro_batch_size=128", "train.lr=3e-3", "train.warmup_steps=5",
                 "log.every_steps=50", "log.eval_every_steps=150", "eval.max_rows=500"]


@pytest.mark.learning
def test_asking_for_the_highest_score_beats_asking_for_the_lowest(world, tmp_path, sft_base):
    """The demonstrations drop the carry in 60% of carry problems: labelled by a rule reward, bucket 0 holds only
    dropped carries, so a model asked for score 0 adds without carrying and one asked for score 1 carries."""
    from hpc_rlhf.trainers import conditional

    reward = tmp_path / "sum_reward.py"
    reward.write_text(REWARD_FILE)
    out = tmp_path / "csft"
    cfg = load_config(conditional.Config, None, [f"output_dir={out}", f"model.path={sft_base}", *QUIET,
                                                 f"score.functions=[{reward}:correct_sum]", *learning(*CSFT_SETTINGS)])
    result = conditional.run(cfg)
    high, low = result["eval_accuracy_bucket_1"], result["eval_accuracy_bucket_0"]
    record_figures("csft", high=high, low=low, gap=high - low, mean_score=result["mean_score"])
    print(f"csft: exact match asking for score 1: {high:.3f}, for score 0: {low:.3f}; "
          f"share of correct demonstrations {result['mean_score']:.3f}")
    # The 2-layer tiny Llama (2026-11-28, seeds 0-4; docs/results.md), 128 rows a step: gap +0.412, +0.276, +0.350,
    # +0.496, +0.388; the control +0.064 (64 rows a step left seed 0 at +0.050). The 4-layer model's figures, 64 rows:
    # Calibrated over seeds 0-4 (500 held-out prompts; scripts/calibrate_learning_tests.py, docs/results.md): gap +0.218 to
    # +0.550 (asking for score 1: 0.50-0.88, for score 0: 0.10-0.40); with train.lr=0: 0.004 and 0.000.
    assert high >= low + 0.12
    # the SFT run's own evaluation asked for the highest bucket: the same figure
    assert read_metrics(out / "sft")[-1]["eval_accuracy"] == pytest.approx(high)
    rows = [json.loads(line) for line in (out / "data" / "csft_data.jsonl").read_text().splitlines()]
    assert len(rows) == 4000 and 0.5 < result["mean_score"] < 0.9
    assert all(r["prompt"].startswith(f"<score:{int(r['score'] >= 0.5)}> ") for r in rows)
    meta = json.loads((out / "final" / "conditional.json").read_text())
    assert meta["ask_bucket"] == 1 and meta["template"] == "<score:{score}> {prompt}"
