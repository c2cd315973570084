import math

import pytest
import torch

from hpc_rlhf.algorithms.kl import kl_estimate, kl_penalized_rewards, last_token_index

LOGPS = torch.tensor([-1.0, -2.0, -3.0])
REF_LOGPS = torch.tensor([-1.5, -1.0, -3.0])  # log r = [0.5, -1.0, 0.0]


def test_k1_k2_k3_hand_computed():
    torch.testing.assert_close(kl_estimate(LOGPS, REF_LOGPS, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl_estimate(LOGPS, REF_LOGPS, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    # exp(-0.5) - 1 + 0.5 = 0.10653066; exp(1) - 1 - 1 = 0.71828183
    torch.testing.assert_close(kl_estimate(LOGPS, REF_LOGPS, "k3"), torch.tensor([0.10653066, 0.71828183, 0.0]))


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    generator = torch.Generator().manual_seed(0)
    policy = torch.tensor([0.5, 0.3, 0.15, 0.05])
    reference = torch.tensor([0.25, 0.25, 0.25, 0.25])
    true_kl = sum(p * math.log(p / q) for p, q in zip(policy.tolist(), reference.tolist()))  # 0.2442
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=generator)
    logps, ref_logps = policy.log()[tokens], reference.log()[tokens]
    for kind in ("k1", "k3"):
        assert kl_estimate(logps, ref_logps, kind).mean().item() == pytest.approx(true_kl, abs=0.01), kind
    assert (kl_estimate(logps, ref_logps, "k3") >= 0).all()
    # k2 is biased: for this pair its mean is well away from the true KL.
    assert abs(kl_estimate(logps, ref_logps, "k2").mean().item() - true_kl) > 0.01


def test_log_ratio_clip_bounds_k3():
    big = kl_estimate(torch.tensor([-100.0]), torch.tensor([-1.0]), "k3", log_ratio_clip=10.0)
    # log r = -99 clipped to -10: exp(10) - 1 - 10
    torch.testing.assert_close(big, torch.tensor([math.exp(10) - 11]))
    # by default |log r| stops at 20: finite, exp(20) - 21 (issue: k3 returned inf at a log-ratio of -100)
    torch.testing.assert_close(kl_estimate(torch.tensor([-100.0]), torch.tensor([-1.0]), "k3"),
                               torch.tensor([math.exp(20) - 21]))
    assert torch.isinf(kl_estimate(torch.tensor([-100.0]), torch.tensor([-1.0]), "k3", log_ratio_clip=None))


def test_k3_gradient_at_equal_policies_is_zero_and_k1_gradient_is_one():
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_estimate(logps, logps.detach(), "k3").sum().backward()
    torch.testing.assert_close(logps.grad, torch.zeros(2))
    logps.grad = None
    kl_estimate(logps, logps.detach() - 0.3, "k1").sum().backward()
    torch.testing.assert_close(logps.grad, torch.ones(2))


def test_kl_estimate_bad_input():
    with pytest.raises(ValueError, match="kind must be one of k1, k2, k3"):
        kl_estimate(LOGPS, REF_LOGPS, "k4")
    with pytest.raises(ValueError, match=r"logps has shape \(3,\).*ref_logps \(2,\)"):
        kl_estimate(LOGPS, REF_LOGPS[:2])


def test_last_token_index_with_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 0, 0]


def test_kl_penalized_rewards_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [0.4, 0.2, 0.1], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1], [0, 0, 0]])
    rewards = kl_penalized_rewards(scores, kl, mask, beta=0.1)
    expected = torch.tensor([
        [-0.01, -0.02, 1.0 - 0.03],  # score lands on the last response token
        [-0.05, 2.0 - 0.05, 0.0],    # right padding gets nothing
        [0.0, -0.02, 3.0 - 0.01],    # left padding (prompt) gets nothing
        [0.0, 0.0, 0.0],             # no response token: no reward at all
    ])
    torch.testing.assert_close(rewards, expected)


def test_kl_penalized_rewards_length_one_and_score_clip():
    rewards = kl_penalized_rewards(torch.tensor([5.0, -7.0]), torch.tensor([[0.2, 9.0], [0.0, 0.0]]),
                                   torch.tensor([[1, 0], [1, 0]]), beta=0.5, score_clip=3.0)
    torch.testing.assert_close(rewards, torch.tensor([[3.0 - 0.1, 0.0], [-3.0, 0.0]]))


def test_kl_penalized_rewards_bad_scores_shape():
    with pytest.raises(ValueError, match=r"scores must have shape \(2,\)"):
        kl_penalized_rewards(torch.zeros(3), torch.zeros(2, 4), torch.ones(2, 4), beta=0.1)
