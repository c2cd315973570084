import math

import pytest
import torch

from hpc_rlhf.algorithms.advantages import (assemble_advantages, broadcast_to_tokens, clip_rewards,
                                            combine_scores, discounted_returns, dr_grpo_advantages, gae,
                                            grpo_advantages, normalize_rewards, reinforce_pp_advantages,
                                            reinforce_pp_baseline_advantages, rl_advantages, rloo_advantages)
from hpc_rlhf.algorithms.kl import kl_estimate


def reference_gae(rewards, values, gamma, lam):
    """Textbook GAE for one unpadded response, scalar by scalar."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


# -------------------------------------------------------------------------------------------------- GAE
def test_gae_hand_computed_with_right_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.7 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03, A1 = 0.03 + 0.72*0.3 = 0.246;
    #        d0 = 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: the padded reward 5 and value 9 are ignored: A1 = 1 - 0.6 = 0.4, A0 = 0.04 + 0.72*0.4 = 0.328
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]]))


def test_gae_matches_textbook_loop_on_random_right_padded_batch():
    torch.manual_seed(0)
    lengths = [5, 1, 3, 7]
    rewards, values = torch.randn(4, 7), torch.randn(4, 7)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    advantages, returns = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    for row, length in enumerate(lengths):
        expected = reference_gae(rewards[row, :length].tolist(), values[row, :length].tolist(), 0.95, 0.9)
        torch.testing.assert_close(advantages[row, :length], torch.tensor(expected))
        torch.testing.assert_close(returns[row, :length], torch.tensor(expected) + values[row, :length])
        assert (advantages[row, length:] == 0).all() and (returns[row, length:] == 0).all()


def test_gae_left_padding_and_holes_skip_masked_positions():
    # The same response [r=0, r=0, r=1] with values [0.5, 0.6, 0.7], placed after a prompt and split by a hole.
    rewards = torch.tensor([[3.0, 0.0, 0.0, 8.0, 1.0]])
    values = torch.tensor([[4.0, 0.5, 0.6, 8.0, 0.7]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    advantages, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.21712, 0.246, 0.0, 0.3]]))


def test_gae_length_one_all_masked_and_monte_carlo_limit():
    rewards = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 1, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # length 1: A = r - V = 1.5. gamma = lam = 1: A_t = (sum of rewards from t on) - V_t.
    torch.testing.assert_close(advantages, torch.tensor([[1.5, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, 4.0, 2.0]]))
    torch.testing.assert_close(returns, torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [6.0, 5.0, 3.0]]))


def test_gae_outputs_are_detached_fp32_targets():
    values = torch.randn(2, 3, requires_grad=True)
    advantages, returns = gae(torch.randn(2, 3).bfloat16(), values, torch.ones(2, 3), 1.0, 0.95)
    assert not advantages.requires_grad and not returns.requires_grad
    assert advantages.dtype == torch.float32


def test_gae_shape_mismatch():
    with pytest.raises(ValueError, match=r"rewards has shape \(2, 3\).*values \(2, 4\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_discounted_returns_hand_computed():
    got = discounted_returns(torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    # G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    torch.testing.assert_close(got, torch.tensor([[2.75, 3.5, 3.0, 0.0]]))


# --------------------------------------------------------------------------------------- group baselines
def test_grpo_hand_computed_including_a_group_of_identical_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 0: mean 0.5, std (n-1) = sqrt(4 * 0.25 / 3) = 0.57735, so +-0.5 / 0.57735 = +-0.866025.
    # group 1: every answer equal: nothing to learn, advantage 0 (not NaN).
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(rewards, n=4), expected, atol=1e-5, rtol=1e-5)
    got_2d = grpo_advantages(rewards.view(2, 4), n=4)
    assert got_2d.shape == (2, 4)
    torch.testing.assert_close(got_2d.flatten(), expected, atol=1e-5, rtol=1e-5)


def test_grpo_without_scale_and_dr_grpo_subtract_the_group_mean_only():
    rewards = torch.tensor([[3.0, 1.0, 2.0], [10.0, 10.0, 4.0]])
    expected = torch.tensor([[1.0, -1.0, 0.0], [2.0, 2.0, -4.0]])
    torch.testing.assert_close(grpo_advantages(rewards, n=3, scale=False), expected)
    torch.testing.assert_close(dr_grpo_advantages(rewards, n=3), expected)


def test_rloo_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    # r_i - mean of the other three: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3; equal rewards give 0.
    expected = torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rloo_advantages(rewards, n=4), expected)


def test_rloo_is_dr_grpo_scaled_by_n_over_n_minus_1():
    torch.manual_seed(1)
    rewards = torch.randn(6, 5)
    torch.testing.assert_close(rloo_advantages(rewards, 5), dr_grpo_advantages(rewards, 5) * 5 / 4)


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_group_baselines_refuse_bad_groups(fn):
    with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be >= 2"):
        fn(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"\(num_prompts \* 4,\).*got shape \(6,\)"):
        fn(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 3\)"):
        fn(torch.zeros(2, 3), 4)


def test_broadcast_to_tokens():
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    torch.testing.assert_close(got, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))


# ------------------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_hand_computed():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma = 1 returns: row 0 [1, 1, 1], row 1 [-1, -1]. Over the 5 tokens: mean 0.2,
    # variance (3 * 0.8^2 + 2 * 1.2^2) / 5 = 0.96, so 0.8 / sqrt(0.96) = 0.816497, -1.2 / sqrt(0.96) = -1.224745.
    expected = torch.tensor([[0.816497, 0.816497, 0.816497], [-1.224745, -1.224745, 0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(token_rewards, mask), expected)


def test_reinforce_pp_discounts_before_whitening():
    token_rewards = torch.tensor([[0.0, 0.0, 4.0]])
    got = reinforce_pp_advantages(token_rewards, torch.ones(1, 3), gamma=0.5)
    # returns [1, 2, 4]: mean 7/3, population std sqrt(((4/3)^2 + (1/3)^2 + (5/3)^2) / 3) = sqrt(14/9)
    std = math.sqrt(14 / 9)
    torch.testing.assert_close(got, torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, (4 - 7 / 3) / std]]))


def test_reinforce_pp_baseline_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # 2 prompts x 2 samples
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    # minus group means: [0.5, -0.5, 0, 0]; on the 7 response tokens: [.5, .5, -.5, 0, 0, 0, 0],
    # mean 1/14, population variance 5/49 (= (2*(3/7)^2 + (4/7)^2 + 4*(1/14)^2) / 7);
    # (0.5 - 1/14) / sqrt(5/49) = 1.341641, (-0.5 - 1/14) / sqrt(5/49) = -1.788854, (0 - 1/14) / ... = -0.223607
    expected = torch.tensor([[1.341641, 1.341641], [-1.788854, 0.0], [-0.223607, -0.223607], [-0.223607, -0.223607]])
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards, 2, mask), expected)
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards.view(2, 2), 2, mask), expected)
    with pytest.raises(ValueError, match=r"mask must be \(4, seq\)"):
        reinforce_pp_baseline_advantages(rewards, 2, mask[:3])


# ---------------------------------------------------------------------------------- reward normalisation
def test_normalize_rewards_with_and_without_mask():
    torch.testing.assert_close(normalize_rewards(torch.tensor([1.0, 2.0, 3.0])),
                               torch.tensor([-1.224745, 0.0, 1.224745]))
    got = normalize_rewards(torch.tensor([1.0, 2.0, 3.0, 50.0]), mask=torch.tensor([1, 1, 1, 0]))
    torch.testing.assert_close(got, torch.tensor([-1.224745, 0.0, 1.224745, 0.0]))
    torch.testing.assert_close(normalize_rewards(torch.tensor([4.0, 4.0])), torch.zeros(2))


def test_clip_rewards():
    torch.testing.assert_close(clip_rewards(torch.tensor([-9.0, -1.0, 0.5, 7.0]), 2.0),
                               torch.tensor([-2.0, -1.0, 0.5, 2.0]))
    with pytest.raises(ValueError, match="clip must be > 0"):
        clip_rewards(torch.zeros(2), 0.0)


# ---------------------------------------------------------------------------------------- rl_advantages
MASK2 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
KL2 = torch.tensor([[0.3, 0.2, 9.0], [0.0, 9.0, 9.0]])  # 9.0 sits on padding and must be ignored


def test_kl_in_the_reward_enters_rloo_before_the_baseline():
    """Scores 1 and 0, sequence KL 0.5 and 0, beta 0.1: rewards 0.95 and 0, so RLOO gives +-0.95 (the KL
    subtracted after the baseline would give 0.95 and -1.0)."""
    adv, returns = rl_advantages(torch.tensor([1.0, 0.0]), KL2, MASK2, estimator="rloo", n=2, kl_coef=0.1)
    torch.testing.assert_close(adv, torch.tensor([[0.95, 0.95, 0.0], [-0.95, 0.0, 0.0]]))
    assert returns is None


def test_kl_in_the_reward_enters_grpo_before_the_group_normalisation():
    # rewards 0.95 and 0: mean 0.475, Bessel std 0.475 * sqrt(2), so A = +-1/sqrt(2)
    adv, _ = rl_advantages(torch.tensor([1.0, 0.0]), KL2, MASK2, estimator="grpo", n=2, kl_coef=0.1)
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0]]), atol=1e-5, rtol=0)


def test_kl_as_a_loss_term_leaves_the_group_rewards_alone():
    adv, _ = rl_advantages(torch.tensor([1.0, 0.0]), KL2, MASK2, estimator="rloo", n=2, kl_coef=0.1,
                           kl_in_reward=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_whiten_false_is_honoured_by_the_reinforce_estimators(estimator):
    scores = torch.tensor([2.0, 0.0])
    adv, _ = rl_advantages(scores, torch.zeros(2, 3), MASK2, estimator=estimator, n=2, whiten=False)
    # reinforce_pp: the return of a final-token score is the score at every token; the baseline variant centres
    # it on the group mean (1.0) first
    expected_scores = [2.0, 0.0] if estimator == "reinforce_pp" else [1.0, -1.0]
    torch.testing.assert_close(adv, torch.tensor([[expected_scores[0]] * 2 + [0.0], [expected_scores[1], 0, 0]]))
    whitened, _ = rl_advantages(scores, torch.zeros(2, 3), MASK2, estimator=estimator, n=2, whiten=True)
    assert abs(float(whitened[MASK2 != 0].mean())) < 1e-6


def test_gae_through_rl_advantages_puts_the_kl_penalty_on_each_token():
    # gamma = lam = 1, V = 0: the advantage at t is the sum of the rewards from t on
    adv, returns = rl_advantages(torch.tensor([1.0, 0.0]), KL2, MASK2, estimator="gae", n=2, kl_coef=0.1,
                                 gamma=1.0, lam=1.0, values=torch.zeros(2, 3), whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0 - 0.05, 1.0 - 0.02, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, adv)


# ------------------------------------------------------------------------------------------ advantage assembly
def test_combine_scores_weights_each_source():
    rule = torch.tensor([1.0, 0.0, 0.5])
    rm1, rm2 = torch.tensor([0.2, 0.4, -1.0]), torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(combine_scores(rule, [rm1, rm2], [2.0, -1.0]), torch.tensor([0.4, -1.2, -4.5]))
    with pytest.raises(ValueError):
        combine_scores(rule, [rm1, rm2], [1.0])


# Two prompts x two samples, responses of 2, 3, 1 and 2 tokens (right padded to 3). The actor's log-probs minus the
# reference's, per token: 9.0 where there is no response token (it must not count anywhere).
ASM_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
ASM_GAP = torch.tensor([[0.1, 0.2, 9.0], [0.0, -0.1, 0.3], [0.5, 9.0, 9.0], [0.2, 0.2, 9.0]])
ASM_REF = torch.full((4, 3), -1.5)
ASM_RULES = torch.tensor([1.0, 0.0, 1.0, 0.0])
ASM_MODELS = [torch.tensor([0.5, 0.5, -0.5, 1.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])]
ASM_WEIGHTS = [2.0, -1.0]


def assemble(estimator: str, **options):
    return assemble_advantages(ASM_RULES, ASM_MODELS, ASM_WEIGHTS, ASM_REF + ASM_GAP, ASM_REF, ASM_MASK,
                               kl_estimator="k1", estimator=estimator, n=2, **options)


def test_advantage_assembly_hand_computed_with_a_group_baseline():
    out = assemble("dr_grpo", kl_coef=0.5, kl_in_reward=True)
    # scores = rules + 2 * rm1 - rm2 = [1 + 1 - 1, 0 + 1 - 0, 1 - 1 - 0, 0 + 2 - 1] = [1, 1, 0, 1]
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    # k1 = the log-prob gap on response tokens only; its sums per sample: 0.3, 0.2, 0.5, 0.4
    torch.testing.assert_close(out.kl, ASM_GAP * ASM_MASK)
    # sequence rewards = score - 0.5 * KL sum = [0.85, 0.9 | -0.25, 0.8]; Dr. GRPO subtracts each prompt's mean
    # (0.875 and 0.275): [-0.025, 0.025 | -0.525, 0.525], given to every response token
    expected = torch.tensor([-0.025, 0.025, -0.525, 0.525]).unsqueeze(1) * ASM_MASK
    torch.testing.assert_close(out.advantages, expected)
    assert out.returns is None


def test_advantage_assembly_hand_computed_with_gae():
    values = torch.tensor([[0.3, 0.4, 7.0], [0.1, 0.2, 0.3], [0.1, 7.0, 7.0], [0.0, 0.5, 7.0]])
    out = assemble("gae", kl_coef=0.5, kl_in_reward=True, gamma=1.0, lam=1.0, values=values, whiten=False)
    # token rewards -0.5 * kl_t, plus the score at the last token: [-0.05, 0.9], [0, 0.05, 0.85], [-0.25],
    # [-0.1, 0.9]; with gamma = lam = 1, A_t = (rewards from t on) - V_t and the returns are A_t + V_t
    expected = torch.tensor([[0.55, 0.5, 0.0], [0.8, 0.7, 0.55], [-0.35, 0.0, 0.0], [0.8, 0.4, 0.0]])
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, torch.tensor([[0.85, 0.9, 0.0], [0.9, 0.9, 0.85], [-0.25, 0.0, 0.0],
                                                          [0.8, 0.9, 0.0]]))


def test_advantage_assembly_without_a_reference_has_no_kl():
    out = assemble_advantages(ASM_RULES, ASM_MODELS, ASM_WEIGHTS, ASM_REF + ASM_GAP, None, ASM_MASK,
                              kl_estimator="k3", estimator="rloo", n=2, kl_coef=0.5)
    assert torch.equal(out.kl, torch.zeros(4, 3))
    # RLOO on the scores alone: [1, 1 | 0, 1] -> [0, 0 | -1, 1]
    torch.testing.assert_close(out.advantages, torch.tensor([0.0, 0.0, -1.0, 1.0]).unsqueeze(1) * ASM_MASK)


def test_advantage_assembly_is_what_its_steps_give_one_by_one():
    """The pure function adds nothing of its own: the same tensors as combine_scores, kl_estimate and
    rl_advantages called in turn (here with k3, the KL as a loss term, normalised and clipped scores)."""
    options = dict(estimator="grpo", n=2, kl_coef=0.3, kl_in_reward=False, normalize_scores=True, score_clip=0.8)
    out = assemble_advantages(ASM_RULES, ASM_MODELS, ASM_WEIGHTS, ASM_REF + ASM_GAP, ASM_REF, ASM_MASK,
                              kl_estimator="k3", **options)
    scores = combine_scores(ASM_RULES, ASM_MODELS, ASM_WEIGHTS)
    kl = kl_estimate(ASM_REF + ASM_GAP, ASM_REF, kind="k3") * ASM_MASK
    advantages, _ = rl_advantages(scores, kl, ASM_MASK, **options)
    assert torch.equal(out.scores, scores) and torch.equal(out.kl, kl) and torch.equal(out.advantages, advantages)


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_the_rounding(estimator):
    # 16 rewards of 0.7: their float32 mean is off by a rounding error, which GRPO's division by the std (then of
    # the same size) blew up to |A| = 0.056 before; 0/1 rewards were exact already.
    rewards = torch.cat([torch.full((16,), 0.7), torch.tensor([0.1, 0.9] * 8)])
    advantages = estimator(rewards, 16)
    assert torch.equal(advantages[:16], torch.zeros(16))
    assert advantages[16:].abs().min() > 0.1


def test_a_teacher_adds_its_per_token_reverse_kl_after_the_rewards_advantages():
    """On-policy distillation: each sampled token's advantage gains coef * (log pi_teacher - log pi_old), on
    response tokens only, after the reward's estimator (here RLOO) and without touching the scores or the KL."""
    logps = ASM_REF + ASM_GAP
    teacher = logps + torch.tensor([[0.5, -1.0, 4.0], [0.0, 2.0, -0.5], [1.5, 4.0, 4.0], [-0.2, 0.0, 4.0]])
    plain = assemble("rloo")
    out = assemble("rloo", teacher_logps=teacher, teacher_coef=0.5)
    # reverse KL per token (k1): log pi_old - log pi_teacher, 0 outside the responses
    torch.testing.assert_close(out.teacher_kl, -torch.tensor([[0.5, -1.0, 0.0], [0.0, 2.0, -0.5], [1.5, 0.0, 0.0],
                                                               [-0.2, 0.0, 0.0]]))
    torch.testing.assert_close(out.advantages - plain.advantages,
                               torch.tensor([[0.25, -0.5, 0.0], [0.0, 1.0, -0.25], [0.75, 0.0, 0.0],
                                             [-0.1, 0.0, 0.0]]))
    torch.testing.assert_close(out.scores, plain.scores)
    torch.testing.assert_close(out.kl, plain.kl)
    assert plain.teacher_kl is None
    # weight 0: the teacher is scored (its KL is there to log) but the advantages are the rewards' alone
    torch.testing.assert_close(assemble("rloo", teacher_logps=teacher, teacher_coef=0.0).advantages,
                               plain.advantages)
