"""Iterative DPO: pairs by hand, and two chained rounds from the session's SFT model that beat the start, the second
trained on pairs sampled from the first's policy; a restart after the last round repeats nothing."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import QUIET, learning, record_figures


def rec(index, sample, score, response):
    return {"index": index, "sample": sample, "score": score, "prompt": f"p{index}", "response": response}


def test_preference_pairs_by_hand():
    from hpc_rlhf.trainers.iterative_dpo import preference_pairs

    records = [rec(0, 0, 0.0, "a"), rec(0, 1, 1.0, "b"), rec(0, 2, 0.0, "c"),  # best b, worst a (earlier tie)
               rec(1, 0, 1.0, "x"), rec(1, 1, 1.0, "y"),                      # no gap: dropped
               rec(2, 0, 0.3, "s"), rec(2, 1, 0.5, "t"),                      # gap 0.2
               rec(3, 0, 0.0, "same"), rec(3, 1, 2.0, "same"),                # same text: dropped
               rec(4, 0, 0.0, " "), rec(4, 1, 1.0, "u"), rec(4, 2, 0.0, "v")]  # blank: not a side
    pairs = preference_pairs(records)
    assert [(p["index"], p["chosen"], p["rejected"]) for p in pairs] == [(0, "b", "a"), (2, "t", "s"), (4, "u", "v")]
    assert pairs[1]["chosen_score"] == 0.5 and pairs[1]["rejected_score"] == 0.3
    assert [p["index"] for p in preference_pairs(records, min_gap=0.5)] == [0, 4]


# From the session's SFT base (0.67 held-out exact match; carry problems 0.28-0.33): sampling at temperature 1 so
# that problems without a carry give pairs too, a learning rate for a good policy (1e-3 wrecked it: 0.695 -> 0.575
# -> 0.655), 40 steps on ~130-200 pairs a round, and the NLL term on the chosen answers (dpo.sft_weight, on by
# default in idpo: without it round 1 fell to 0.045). The reference of each round is the policy it started from.
IDPO_SETTINGS = ["rounds=2", "data.max_train_rows=256", "generate.n=8", "generate.chunk_size=64",
                 "generate.max_new_tokens=5", "generate.temperature=1.0", "dpo.beta=0.1", "train.max_steps=40",
                 "train.batch_size=32", "train.micro_batch_size=32", "train.lr=3e-5", "train.warmup_steps=5",
                 "log.every_steps=20", "log.eval_every_steps=40", "data.max_eval_rows=8", "eval.max_rows=500"]


def carries(prompt: str) -> bool:
    a, b = prompt.rstrip("=").split("+")
    return int(a) % 10 + int(b) % 10 >= 10


def dropped_carry_share(generations: list[dict]) -> float:
    """Among a round's samples of carry problems, the share that dropped the carry (the demonstrations' mistake:
    the right sum minus 10)."""
    carry = [g for g in generations if carries(g["prompt"])]
    return sum(g["response"] == str(int(g["answer"]) - 10) for g in carry) / len(carry)


# The 2-layer tiny Llama (2026-11-28, seeds 0-4 and the control; docs/results.md): gain +0.286, +0.208, +0.168,
# +0.194, +0.120; the share of round 1's samples of carry problems that drop the carry minus round 2's 0.475, 0.294,
# 0.307, 0.254, 0.462 (the control -0.039). The old second check, the shift of the pairs' share without a carry,
# moved +0.033 at seed 3, under the control's +0.041: it measures how far round 1 overshoots, which varies; the
# check now is that round 2 sampled a policy that learned to carry. The 4-layer model's figures:
# Calibrated over seeds 0-4 (scripts/calibrate_learning_tests.py; figures in docs/results.md): after two rounds held-out
# exact match is up by +0.16 to +0.28, but neither round alone gains on every seed (round 1: -0.04 to +0.21,
# round 2: -0.01 to +0.20: one round's overshoot is the next round's correction). Round 2's pairs come from round
# 1's policy and its new mistakes: their share without a carry rises by 0.18 to 0.49. With train.lr=0 the gain
# is 0 and the share moves by 0.07 (the same policy sampled again with another seed). On an Intel machine (other
# bits for one seed: hpc_rlhf/utils/cpu_kernels.py), seeds 0-2: gain +0.18, +0.20, +0.27; share +0.117, +0.053
# (below the control's: seed 1 fails here), +0.47.
IDPO_GAIN = 0.08
DROPPED_CARRY_FALL = 0.12


@pytest.mark.learning
def test_two_rounds_beat_the_start_and_the_second_samples_the_first(world, tmp_path, sft_base):
    """Round 1's pairs are mostly carry problems (the SFT model drops the carry it was shown dropped), so it learns
    to carry, and tends to overshoot into carrying where there is none; round 2 samples that policy, whose carry
    problems seldom drop the carry any more, and its pairs hold the new mistakes. Offline pairs could not: this is
    what the rounds are for."""
    from hpc_rlhf.trainers import iterative_dpo

    out = tmp_path / "idpo"
    cfg = load_config(iterative_dpo.Config, None, [f"output_dir={out}", f"model.path={sft_base}", *QUIET,
                                                   *learning(*IDPO_SETTINGS, sampling=True)])
    result = iterative_dpo.run(cfg)
    first, second = read_metrics(out / "round_1" / "dpo"), read_metrics(out / "round_2" / "dpo")
    start, after_1, after_2 = first[0]["eval_exact_match"], first[-1]["eval_exact_match"], \
        second[-1]["eval_exact_match"]
    rounds = read_metrics(out)
    pairs = [[json.loads(line) for line in (out / f"round_{r}" / "pairs.jsonl").read_text().splitlines()]
             for r in (1, 2)]
    no_carry = [sum(not carries(p["prompt"]) for p in round_pairs) / len(round_pairs) for round_pairs in pairs]
    dropped = [dropped_carry_share([json.loads(line) for line in
                                    (out / f"round_{r}" / "generations.jsonl").read_text().splitlines()])
               for r in (1, 2)]
    record_figures("idpo", start=start, round_1=after_1, round_2=after_2, gain=after_2 - start,
                   gain_1=after_1 - start, gain_2=after_2 - after_1, pairs_shift=no_carry[1] - no_carry[0],
                   dropped_carry=dropped, dropped_carry_fall=dropped[0] - dropped[1])
    print(f"idpo: exact match {start:.3f} -> round 1 {after_1:.3f} -> round 2 {after_2:.3f}; pairs "
          f"{[r['pairs'] for r in rounds]}, share without a carry {[round(x, 2) for x in no_carry]}; samples of carry "
          f"problems that drop it {[round(x, 3) for x in dropped]}")
    assert second[0]["eval_exact_match"] == after_1  # round 2 starts from round 1's policy
    assert after_2 >= start + IDPO_GAIN, (start, after_1, after_2)
    assert dropped[1] <= dropped[0] - DROPPED_CARRY_FALL, dropped  # round 2 sampled round 1's policy
    assert all(p["chosen_score"] > p["rejected_score"] for round_pairs in pairs for p in round_pairs)
    assert (out / "final" / "model.safetensors").is_file() and result["round"] == 2

    again = iterative_dpo.run(cfg)
    assert again["complete"] and "pairs" not in again
