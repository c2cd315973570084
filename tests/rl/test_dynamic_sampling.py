"""Dynamic sampling's rounds in the RL step (rl/dynamic_sampling.py): which groups fill the trained batch, what
travels with them, and the prompts and seeds of each round."""

from __future__ import annotations

import torch

from hpc_rlhf.config import load_config
from hpc_rlhf.data.order import step_indices
from hpc_rlhf.rl import grpo
from hpc_rlhf.rl.dynamic_sampling import ROUND_SEED_OFFSET, Rounds, round_seed
from hpc_rlhf.rl.batches import Generated, make_batch, to_ragged
from hpc_rlhf.rl.prompts import batch_rows
from hpc_rlhf.rl.rollout import batch_seed

N, PROMPTS = 2, 3


def a_round(first_id: int, rules: list[float], reward: list[float]):
    """A scored round of 3 prompts x 2 samples: prompt k is [first_id + k], sample s of it answers [10 * k + s];
    per-token results encode (round, sample) so the test can tell where each landed."""
    prompt_ids = [[first_id + k] for k in range(PROMPTS) for _ in range(N)]
    responses = [torch.tensor([10 * k + s, 7]) for k in range(PROMPTS) for s in range(N)]
    batch = make_batch(prompt_ids, responses, pad_id=0)
    marks = torch.arange(PROMPTS * N, dtype=torch.float32) + first_id * 100
    dense = torch.zeros(batch.action_mask.shape)
    for i in range(PROMPTS * N):
        dense[i] = marks[i] * batch.action_mask[i]
    scored = {"actor": dense.clone(), "ref": dense.clone() - 1, "rules": torch.tensor(rules),
              "reward": torch.tensor(reward)}
    return prompt_ids, Generated(responses, [torch.zeros(len(r)) for r in responses]), batch, dense.clone(), scored


def rounds_of(cfg_overrides=()):
    cfg = load_config(grpo.Config, None, [f"rollout.n_samples={N}", f"rollout.prompts_per_step={PROMPTS}",
                                          "train.batch_size=6", "train.micro_batch_size=6",
                                          "reward.models=[rm]", "placement=actor=1,ref=1,reward=1,rollout=1",
                                          *cfg_overrides])
    return Rounds(cfg, ["reward"])


def test_the_batch_fills_with_signal_in_round_then_prompt_order_and_what_travels_with_it():
    rounds = rounds_of()
    # round 0: prompt 0 uniform (1, 1), prompt 1 differs, prompt 2 uniform once the reward model is added (0+1, 1+0)
    rounds.add(*a_round(1, rules=[1, 1, 0, 1, 0, 1], reward=[0, 0, 0, 0, 1, 0]))
    assert not rounds.full()
    # round 1: prompt 0 differs, prompt 1 differs, prompt 2 uniform
    rounds.add(*a_round(10, rules=[0, 1, 1, 0, 0, 0], reward=[0, 0, 0, 0, 0, 0]))
    assert rounds.full()
    batch, generated, rollout_logps, scored, keep = rounds.assemble(pad_id=0)
    responses = generated.responses
    # chosen: round 0 prompt 1, round 1 prompts 0 and 1; no slot left empty
    assert [int(batch.input_ids[i, 0]) for i in range(6)] == [2, 2, 10, 10, 11, 11]
    assert [r.tolist() for r in responses] == [[10, 7], [11, 7], [0, 7], [1, 7], [10, 7], [11, 7]]
    assert keep.tolist() == [True] * 6
    assert scored["rules"].tolist() == [0, 1, 0, 1, 1, 0] and scored["reward"].tolist() == [0, 0, 0, 0, 0, 0]
    marks = [int(values[0]) for values in to_ragged(scored["actor"], batch)]
    assert marks == [102, 103, 1000, 1001, 1002, 1003]  # (round first_id * 100 + sample) of each chosen sample
    assert torch.equal(to_ragged(scored["ref"], batch)[0], to_ragged(scored["actor"], batch)[0] - 1)
    assert torch.equal(rollout_logps, scored["actor"])
    figures = rounds.figures()
    assert figures["generation_rounds"] == 2 and figures["groups_unfilled"] == 0
    assert figures["groups_filtered_share"] == 3 / 6


def test_short_of_signal_the_slots_left_are_round_0_groups_kept_out_of_the_loss():
    rounds = rounds_of()
    rounds.add(*a_round(1, rules=[1, 1, 0, 1, 0, 0], reward=[0] * 6))  # only prompt 1 carries signal
    batch, _, _, scored, keep = rounds.assemble(pad_id=0)
    assert [int(batch.input_ids[i, 0]) for i in range(6)] == [2, 2, 1, 1, 3, 3]  # chosen first, then fillers
    assert keep.tolist() == [True, True, False, False, False, False]
    assert rounds.figures()["groups_unfilled"] == 2


def test_round_0_is_the_ordinary_batch_and_other_rounds_draw_other_prompts_and_seeds():
    batch_rows.cache_clear()
    assert batch_rows(1000, 16, 7, 3) == batch_rows(1000, 16, 7, 3, 0) == tuple(step_indices(1000, 16, 7, 3))
    assert batch_rows(1000, 16, 7, 3, 1) != batch_rows(1000, 16, 7, 3, 0)
    assert round_seed(3, 7, 0) == batch_seed(3, 7)
    assert round_seed(3, 7, 2) == batch_seed(3, 7) + 2 * ROUND_SEED_OFFSET
    assert len({round_seed(0, b, r) for b in range(100) for r in range(3)}) == 300
