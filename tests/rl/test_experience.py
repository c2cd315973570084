"""Phase 6 (rl/experience.py): what the roles scored becomes the step's Experience, checked on a hand-made GRPO
batch of two prompts x two samples."""

import pytest
import torch

from hpc_rlhf.config import load_config
from hpc_rlhf.rl import grpo
from hpc_rlhf.rl.batches import make_batch
from hpc_rlhf.rl.experience import build_experience

EOS = 2


def cfg(*overrides):
    return load_config(grpo.Config, None, ["placement=actor=1,rollout=1", "rl.kl_coef=0", "rollout.n_samples=2",
                                           "rollout.max_new_tokens=3", "rl.whiten_advantages=false", "rollout.prompts_per_step=2",
                                           "train.batch_size=4", "train.micro_batch_size=4", *overrides])


def batch():
    # responses of 3 tokens without EOS are cut by the length limit; the others end with EOS or are shorter
    responses = [torch.tensor([5, EOS]), torch.tensor([6, 7, 8]), torch.tensor([9]), torch.tensor([5, 6, EOS])]
    return make_batch([[1, 3], [1, 3], [1, 4], [1, 4]], responses, pad_id=0)


def scored(b, rules):
    zeros = torch.zeros(b.action_mask.shape)
    return {"actor": zeros - 1.0, "rules": torch.tensor(rules)}


def test_group_advantages_and_the_loss_mask_from_the_rule_scores():
    b = batch()
    exp, figures = build_experience(cfg(), b, scored(b, [1.0, 0.0, 0.0, 0.0]), torch.zeros(b.action_mask.shape),
                                    [], EOS)
    # GRPO without whitening: score minus its group's mean, over the group's std; prompt 2's group is uniform
    per_sample = exp.advantages.sum(-1) / b.action_mask.sum(-1)
    assert per_sample[0] > 0 > per_sample[1] and torch.equal(per_sample[2:], torch.zeros(2))
    assert torch.equal(exp.scores, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(exp.loss_mask, b.action_mask)  # no filter, no correction: every response token
    assert torch.equal(exp.kl, torch.zeros_like(exp.kl)) and exp.is_weights is None
    assert figures == {"truncated_share": 0.25}  # sample 1: 3 tokens, no EOS


def test_the_overlong_filter_and_dynamic_samplings_leftovers_leave_the_loss():
    b = batch()
    keep = torch.tensor([True, True, False, False])  # prompt 2 is a slot dynamic sampling could not fill
    exp, _ = build_experience(cfg("rl.overlong_filter=true"), b, scored(b, [1.0, 0.0, 0.0, 0.0]),
                              torch.zeros(b.action_mask.shape), [], EOS, keep_samples=keep)
    trained = exp.loss_mask.sum(-1)
    assert trained.tolist() == [2.0, 0.0, 0.0, 0.0]  # sample 1 cut by the limit, samples 2-3 left out


def test_the_overlong_penalty_is_added_to_the_rule_scores():
    b = batch()
    exp, _ = build_experience(cfg("rl.overlong_buffer=2", "rl.overlong_penalty=1.0"), b,
                              scored(b, [1.0, 1.0, 1.0, 1.0]), torch.zeros(b.action_mask.shape), [], EOS)
    # limit 3, buffer 2: lengths 2 and 3 fall in the buffer (penalties 0.5 and 1.0), length 1 does not
    assert exp.scores.tolist() == pytest.approx([0.5, 0.0, 1.0, 0.0])
