import math

import pytest
import torch
import torch.nn.functional as F

from hpc_rlhf.algorithms.losses import (aggregate_loss, cispo_loss, distillation_loss, dpo_loss, gspo_loss, kto_loss,
                                        loss_mask,
                                        loss_normalizer, pairwise_reward_loss, policy_loss, process_reward_loss,
                                        sft_loss, value_loss)

NAN = float("nan")


# ------------------------------------------------------------------------------------------------------ SFT
def test_sft_loss_hand_computed_with_ignored_tokens():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [1.0, 2.0, 3.0]]])
    labels = torch.tensor([[2, -100, 0]])
    # -log p: 3.40760596 - 3 = 0.40760596 and 3.40760596 - 1 = 2.40760596; mean over the 2 learnt tokens.
    torch.testing.assert_close(sft_loss(logits, labels), torch.tensor(1.40760596))


def test_distillation_loss_hand_computed_with_ignored_tokens_and_ruled_out_words():
    INF = float("inf")
    student = torch.tensor([[[0.0, math.log(3.0)], [9.0, 1.0], [0.0, math.log(3.0)], [0.0, -INF]]])
    teacher = torch.tensor([[[0.0, 0.0], [1.0, 9.0], [0.0, -INF], [0.0, -INF]]])
    labels = torch.tensor([[1, -100, 0, 0]])
    # p_student = (1/4, 3/4): against (1/2, 1/2) -(ln(1/4) + ln(3/4)) / 2 = 0.83698822; against (1, 0) ln 4 =
    # 1.38629436; the last token, ruled out by both, 0 (not 0 x -inf); the second is not learnt. Mean of three.
    loss = distillation_loss(student, teacher, labels)
    torch.testing.assert_close(loss, torch.tensor((0.83698822 + 1.38629436 + 0.0) / 3))
    assert distillation_loss(student, teacher, torch.full_like(labels, -100)).item() == 0.0


def test_distillation_loss_is_the_forward_kl_plus_the_teachers_entropy_and_its_gradient_pulls_to_the_teacher():
    torch.manual_seed(0)
    student = torch.randn(2, 5, 7, requires_grad=True)
    teacher = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, :2] = -100
    loss = distillation_loss(student, teacher, labels)
    loss.backward()
    learnt = labels != -100
    p_teacher, logp_student = teacher.softmax(-1)[learnt], student.detach().log_softmax(-1)[learnt]
    kl = F.kl_div(logp_student, p_teacher, reduction="none").sum(-1)
    entropy = -(p_teacher * p_teacher.log()).sum(-1)
    torch.testing.assert_close(loss.detach(), (kl + entropy).mean())
    expected = torch.zeros_like(student)
    expected[learnt] = (logp_student.exp() - p_teacher) / int(learnt.sum())
    torch.testing.assert_close(student.grad, expected)
    with pytest.raises(ValueError, match="share the vocabulary"):
        distillation_loss(student, teacher[..., :6], labels)


def test_sft_loss_matches_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, :3] = -100  # a prompt that is not learnt
    ours = sft_loss(logits, labels)
    ours.backward()
    ours_grad = logits.grad.clone()
    logits.grad = None
    reference = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours_grad, logits.grad)


def test_sft_loss_with_no_learnt_token_is_zero_with_zero_gradient():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss = sft_loss(logits, torch.full((1, 3), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert (logits.grad == 0).all()


def test_sft_loss_other_ignore_index_and_bad_labels():
    logits = torch.zeros(1, 2, 4)
    torch.testing.assert_close(sft_loss(logits, torch.tensor([[1, 0]]), ignore_index=0), torch.tensor(math.log(4)))
    with pytest.raises(ValueError, match="token ids"):
        sft_loss(logits, torch.tensor([[1, -5]]))


# ------------------------------------------------------------------------------------------- reward model
def test_pairwise_reward_loss_hand_computed():
    loss, accuracy = pairwise_reward_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    # -log sigmoid(1) = 0.31326169, -log sigmoid(-1) = 1.31326169
    torch.testing.assert_close(loss, torch.tensor(0.81326169))
    assert accuracy.item() == 0.5


def test_pairwise_reward_loss_with_margin_and_ties():
    loss, accuracy = pairwise_reward_loss(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]),
                                          margin=torch.tensor([0.5, 0.0, 0.0]))
    # -log sigmoid(0.5) = 0.47407698, -log sigmoid(-1) = 1.31326169, -log sigmoid(0) = log 2 = 0.69314718
    torch.testing.assert_close(loss, torch.tensor((0.47407698 + 1.31326169 + 0.69314718) / 3))
    assert accuracy.item() == pytest.approx(1 / 3)  # the tie counts as wrong


def test_pairwise_reward_loss_gradient_separates_the_pair():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_reward_loss(chosen, rejected)[0].backward()
    # d/dx -log sigmoid(x) at 0 is -1/2: descent raises chosen and lowers rejected.
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_process_reward_loss_hand_computed():
    # Marker 1: logits (2, 0), label "+": -log(e^2 / (e^2 + 1)) = log(1 + e^-2) = 0.12692801.
    # Marker 2: logits (0, 0), soft label 0.25: -(0.25 log 0.5 + 0.75 log 0.5) = log 2 = 0.69314718.
    # Marker 3: logits (1, 3), label "+": log(1 + e^2) = 2.12692801.
    loss, accuracy = process_reward_loss(torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 3.0]]),
                                         torch.tensor([[1.0, 0.0], [0.25, 0.75], [1.0, 0.0]]))
    torch.testing.assert_close(loss, torch.tensor((0.12692801 + 0.69314718 + 2.12692801) / 3))
    # Right at marker 1; marker 2's tie reads as "+" against a label leaning "-"; wrong at marker 3.
    assert accuracy.item() == pytest.approx(1 / 3)


def test_process_reward_loss_gradient_moves_the_label_token_up():
    logits = torch.zeros(1, 2, requires_grad=True)
    process_reward_loss(logits, torch.tensor([[0.0, 1.0]]))[0].backward()
    # d/dz_k of the cross-entropy is softmax(z)_k - q_k: (0.5 - 0, 0.5 - 1).
    assert logits.grad.tolist() == [[0.5, -0.5]]


# ------------------------------------------------------------------------------------------------------ DPO
# h = (-1 - -1.5) - (-2 - -1.5) = 0.5 + 0.5 = 1
DPO_ARGS = dict(policy_chosen_logps=torch.tensor([-1.0]), policy_rejected_logps=torch.tensor([-2.0]),
                ref_chosen_logps=torch.tensor([-1.5]), ref_rejected_logps=torch.tensor([-1.5]))


def test_dpo_sigmoid_hand_computed():
    loss, chosen_rewards, rejected_rewards = dpo_loss(**DPO_ARGS, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor(0.64439666))  # -log sigmoid(0.1)
    torch.testing.assert_close(chosen_rewards, torch.tensor([0.05]))  # 0.1 * (-1 - -1.5)
    torch.testing.assert_close(rejected_rewards, torch.tensor([-0.05]))


def test_cdpo_label_smoothing_hand_computed():
    loss, _, _ = dpo_loss(**DPO_ARGS, beta=0.1, label_smoothing=0.1)
    # 0.9 * -log sigmoid(0.1) + 0.1 * -log sigmoid(-0.1) = 0.9 * 0.64439666 + 0.1 * 0.74439666
    torch.testing.assert_close(loss, torch.tensor(0.65439666))


def test_ipo_hand_computed():
    loss, _, _ = dpo_loss(**DPO_ARGS, beta=0.1, loss_type="ipo")
    torch.testing.assert_close(loss, torch.tensor(16.0))  # (1 - 1 / 0.2)^2
    loss, _, _ = dpo_loss(**DPO_ARGS, beta=0.5, loss_type="ipo")
    torch.testing.assert_close(loss, torch.tensor(0.0))  # h already equals the target 1 / (2 * 0.5)


def test_dpo_at_the_reference_is_log_2_and_pushes_chosen_up():
    chosen = torch.tensor([-3.0, -4.0], requires_grad=True)
    rejected = torch.tensor([-2.0, -5.0], requires_grad=True)
    loss, _, _ = dpo_loss(chosen, rejected, chosen.detach(), rejected.detach(), beta=0.2)
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))
    loss.backward()
    # d/dh -log sigmoid(beta h) at h = 0 is -beta/2, averaged over 2 pairs: -0.05 per chosen, +0.05 per rejected.
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.05, -0.05]))
    torch.testing.assert_close(rejected.grad, torch.tensor([0.05, 0.05]))


def test_dpo_reference_gets_no_gradient_and_bad_arguments():
    ref = torch.tensor([-1.5], requires_grad=True)
    loss, _, _ = dpo_loss(torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0]), ref, ref, beta=0.1)
    loss.backward()
    assert ref.grad is None
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, ipo"):
        dpo_loss(**DPO_ARGS, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing .* applies to loss_type=.sigmoid. only"):
        dpo_loss(**DPO_ARGS, beta=0.1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(**DPO_ARGS, beta=0.0)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(**{**DPO_ARGS, "ref_rejected_logps": torch.zeros(2)}, beta=0.1)


# ------------------------------------------------------------------------------------------------------ KTO
def test_kto_hand_computed():
    loss, rewards = kto_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.5]), torch.tensor([True, False]),
                             kl_reference=0.2, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    # r = [0.5, -0.5]. desirable: 1 - sigmoid(0.5 * (0.5 - 0.2)) = 0.46257015;
    # undesirable: 1.5 * (1 - sigmoid(0.5 * (0.2 + 0.5))) = 0.62007363; mean 0.54132189
    torch.testing.assert_close(loss, torch.tensor(0.54132189))
    torch.testing.assert_close(rewards, torch.tensor([0.25, -0.25]))


def test_kto_reference_point_is_clamped_at_zero_and_detached():
    kl_reference = torch.tensor(-0.4, requires_grad=True)
    policy_logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, _ = kto_loss(policy_logps, torch.tensor([-1.5, -1.5]), torch.tensor([1, 0]), kl_reference,
                       beta=0.5, undesirable_weight=1.5)
    # z0 = 0: (1 - sigmoid(0.25)) + 1.5 * (1 - sigmoid(0.25)), halved
    torch.testing.assert_close(loss, torch.tensor(0.54727937))
    loss.backward()
    assert kl_reference.grad is None
    # Descent raises the desirable answer's log-prob and lowers the undesirable one's.
    assert policy_logps.grad[0] < 0 < policy_logps.grad[1]


def test_kto_all_desirable_batch_and_bad_arguments():
    loss, _ = kto_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([True]), 0.0, beta=0.1,
                       desirable_weight=2.0)
    torch.testing.assert_close(loss, torch.tensor(1.0))  # 2 * (1 - sigmoid(0))
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_loss(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool), 0.0, beta=-1.0)
    with pytest.raises(ValueError, match="labels_desirable"):
        kto_loss(torch.zeros(2), torch.zeros(2), torch.ones(3, dtype=torch.bool), 0.0, beta=0.1)


# ------------------------------------------------------------------------------------------------------ PPO
# Row 0: ratios 1.5 (A=+1), 0.5 (A=-1), 1.1 (A=+2). Row 1: ratio 1 (A=-0.5), then padding holding garbage.
RATIOS = torch.tensor([[1.5, 0.5, 1.1], [1.0, 1.0, 1.0]])
OLD_LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, NAN, float("-inf")]])
ADVANTAGES = torch.tensor([[1.0, -1.0, 2.0], [-0.5, NAN, 3.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def ppo_logps():
    logps = (OLD_LOGPS.nan_to_num(0.0, neginf=0.0) + RATIOS.log()).masked_fill(MASK == 0, 50.0)
    return logps.requires_grad_()


def test_policy_loss_hand_computed_token_mean():
    logps = ppo_logps()
    loss, clip_fraction, approx_kl = policy_loss(logps, OLD_LOGPS, ADVANTAGES, MASK, clip_eps=0.2)
    # per-token -min(rho A, clip(rho, 0.8, 1.2) A): -min(1.5, 1.2) = -1.2 (clipped), -min(-0.5, -0.8) = 0.8
    # (clipped), -min(2.2, 2.2) = -2.2, -min(-0.5, -0.5) = 0.5. Mean over 4 tokens: -2.1 / 4.
    torch.testing.assert_close(loss, torch.tensor(-0.525))
    assert clip_fraction.item() == 0.5
    # k3 of KL(old || new) per token: rho - 1 - log rho = 0.09453489, 0.19314718, 0.00468982, 0
    torch.testing.assert_close(approx_kl, torch.tensor(0.07309297))
    loss.backward()
    # Clipped tokens get no gradient; d/dlogp of -rho A / 4 elsewhere: -1.1 * 2 / 4 and -1 * -0.5 / 4.
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, -0.55], [0.125, 0.0, 0.0]]))


@pytest.mark.parametrize("loss_agg, expected", [
    ("seq-mean-token-sum", (-2.6 + 0.5) / 2),       # row sums -2.6 and 0.5
    ("seq-mean-token-mean", (-2.6 / 3 + 0.5) / 2),  # row means -0.8667 and 0.5
])
def test_policy_loss_sequence_aggregations(loss_agg, expected):
    loss, _, _ = policy_loss(ppo_logps(), OLD_LOGPS, ADVANTAGES, MASK, loss_agg=loss_agg)
    torch.testing.assert_close(loss, torch.tensor(expected))


def test_sequence_aggregation_leaves_out_empty_rows():
    token_loss = torch.tensor([[1.0, 3.0], [5.0, 5.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    torch.testing.assert_close(aggregate_loss(token_loss, mask, "token-mean"), torch.tensor(2.0))
    torch.testing.assert_close(aggregate_loss(token_loss, mask, "seq-mean-token-sum"), torch.tensor(3.0))
    torch.testing.assert_close(aggregate_loss(token_loss, mask, "seq-mean-token-mean"), torch.tensor(2.0))
    torch.testing.assert_close(aggregate_loss(token_loss, torch.zeros(3, 2), "seq-mean-token-mean"),
                               torch.tensor(0.0))


def test_clip_higher_only_moves_the_upper_bound():
    logps = torch.log(torch.tensor([[1.25, 0.75]]))
    old_logps = torch.zeros(1, 2)
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    symmetric, clipped_sym, _ = policy_loss(logps, old_logps, advantages, mask, clip_eps=0.2)
    higher, clipped_high, _ = policy_loss(logps, old_logps, advantages, mask, clip_eps=0.2, clip_eps_high=0.28)
    # symmetric: (-1.2 + 0.8) / 2, both clipped; clip-higher: 1.25 < 1.28 is no longer clipped: (-1.25 + 0.8) / 2
    torch.testing.assert_close(symmetric, torch.tensor(-0.2))
    torch.testing.assert_close(higher, torch.tensor(-0.225))
    assert clipped_sym.item() == 1.0 and clipped_high.item() == 0.5


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logps = torch.log(torch.tensor([[5.0, 5.0, 1.0]])).requires_grad_()
    advantages = torch.tensor([[-1.0, 1.0, -2.0]])
    loss, clip_fraction, _ = policy_loss(logps, torch.zeros(1, 3), advantages, torch.ones(1, 3), dual_clip=3.0)
    # A=-1, rho=5: -min(-5, -1.2) = 5, bounded by 3 * 1 = 3. A=+1, rho=5: -1.2 (ordinary clip). A=-2, rho=1: 2.
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2 + 2.0) / 3))
    assert clip_fraction.item() == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, 2.0 / 3]]))


def test_policy_loss_length_one_and_at_old_policy():
    logps = torch.tensor([[-0.3, 0.0]], requires_grad=True)
    loss, clip_fraction, approx_kl = policy_loss(logps, logps.detach(), torch.tensor([[2.0, 0.0]]),
                                                 torch.tensor([[1, 0]]))
    torch.testing.assert_close(loss, torch.tensor(-2.0))
    assert clip_fraction.item() == 0.0 and approx_kl.item() == 0.0
    loss.backward()
    # On-policy, the gradient of -rho A is -A: the plain policy gradient.
    torch.testing.assert_close(logps.grad, torch.tensor([[-2.0, 0.0]]))


def test_policy_loss_bad_arguments():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="loss_agg must be one of token-mean"):
        policy_loss(*args, loss_agg="sum")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(*args, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"advantages \(1, 3\)"):
        policy_loss(args[0], args[1], torch.zeros(1, 3), args[3])


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.5], [NAN, 0.0, 0.0]], requires_grad=True)
    old_values = torch.tensor([[0.9, 1.5, 0.5], [0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.2, 2.5, 0.4], [NAN, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    loss, clip_fraction = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    # token 0: within the clip, (1 - 1.2)^2 = 0.04. token 1: V moved 0.5 > 0.2, V_clip = 1.7,
    # max((2 - 2.5)^2, (1.7 - 2.5)^2) = 0.64 (clipped term wins). token 2: (0.5 - 0.4)^2 = 0.01.
    torch.testing.assert_close(loss, torch.tensor(0.5 * 0.69 / 3))
    torch.testing.assert_close(clip_fraction, torch.tensor(1 / 3))
    loss.backward()
    # The clipped token gets no gradient; others: (V - R) / 3.
    torch.testing.assert_close(values.grad, torch.tensor([[-0.2 / 3, 0.0, 0.1 / 3], [0.0, 0.0, 0.0]]))


def test_value_loss_without_clipping():
    loss, clip_fraction = value_loss(torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([[0.9, 1.5, 0.5]]),
                                     torch.tensor([[1.2, 2.5, 0.4]]), torch.ones(1, 3), clip_eps=None)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.04 + 0.25 + 0.01) / 3))
    assert clip_fraction.item() == 0.0


def test_token_mean_over_two_micro_batches_of_different_lengths_weighs_every_token_alike():
    """A 100-token and a 2-token answer in two micro-batches: with the step's token count as normalizer each
    token's gradient is -A / 102 (the true token mean), not -A / 100 and -A / 2 (a mean of per-batch means)."""
    long_logps = torch.zeros(1, 100, requires_grad=True)
    short_logps = torch.zeros(1, 2, requires_grad=True)
    total = 102.0
    for logps in (long_logps, short_logps):
        ones = torch.ones_like(logps)
        loss, _, _ = policy_loss(logps, torch.zeros_like(logps), ones, ones, normalizer=total)
        loss.backward()
    torch.testing.assert_close(long_logps.grad, torch.full((1, 100), -1 / 102))
    torch.testing.assert_close(short_logps.grad, torch.full((1, 2), -1 / 102))


def test_seq_mean_normalizer_counts_sequences_of_the_step():
    token_loss = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # per-sequence sums 4 and 2, over the 4 sequences of the whole step -> 6 / 4
    assert aggregate_loss(token_loss, mask, "seq-mean-token-sum", normalizer=4).item() == pytest.approx(1.5)
    assert loss_normalizer(mask, "token-mean") == 3 and loss_normalizer(mask, "seq-mean-token-mean") == 2


def test_a_huge_log_ratio_gives_finite_loss_and_gradients():
    logps = torch.tensor([[100.0, -100.0, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    for advantage in (1.0, -1.0):
        logps.grad = None
        loss, _, approx_kl = policy_loss(logps, old, torch.full((1, 3), advantage), torch.ones(1, 3),
                                         dual_clip=3.0 if advantage < 0 else None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(approx_kl) and torch.isfinite(logps.grad).all()


def test_token_weights_scale_each_tokens_loss():
    logps = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]])
    loss, _, _ = policy_loss(logps, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), token_weights=weights)
    loss.backward()
    torch.testing.assert_close(logps.grad, -weights / 2)


def test_value_loss_normalizer_gives_the_step_token_mean():
    values = torch.tensor([[1.0, 1.0]])
    loss, _ = value_loss(values, values, torch.zeros(1, 2), torch.ones(1, 2), clip_eps=None, normalizer=8)
    assert loss.item() == pytest.approx(0.5 * 2 / 8)


# ----------------------------------------------------------------------------------------- loss mask
def test_loss_mask_keeps_what_every_mask_keeps():
    action_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    keep_tokens = torch.tensor([[True, False, True], [True, True, True], [True, True, True]])
    keep_sequences = torch.tensor([True, False, True])
    assert loss_mask(action_mask).equal(action_mask.bool())
    assert loss_mask(action_mask, keep_tokens).equal(torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0]]).bool())
    assert loss_mask(action_mask, keep_tokens, keep_sequences).equal(
        torch.tensor([[1, 0, 1], [0, 0, 0], [0, 0, 0]]).bool())
    with pytest.raises(ValueError, match=r"keep_sequences must be \(batch,\) = \(3,\)"):
        loss_mask(action_mask, keep_sequences=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape mismatch"):
        loss_mask(action_mask, keep_tokens=torch.ones(3, 2))


def random_batch(seed: int, batch: int = 6, seq: int = 7, spread: float = 0.1):
    """Log-probs near the old ones, random right-padded lengths (row 1 empty), garbage in the padding."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=generator, dtype=torch.float64) * 3
    logps = old + torch.randn(batch, seq, generator=generator, dtype=torch.float64) * spread
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    lengths[1] = 0
    mask = (torch.arange(seq) < lengths.unsqueeze(-1)).long()
    advantages = torch.randn(batch, seq, generator=generator, dtype=torch.float64)
    sequence_advantages = advantages[:, :1].expand(batch, seq).clone()
    garbage = mask == 0
    logps = logps.masked_fill(garbage, NAN).requires_grad_()
    return logps, old.masked_fill(garbage, float("inf")), advantages, sequence_advantages, mask


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_a_dropped_answer_counts_nowhere_in_the_policy_loss(loss_agg):
    """Dropping answers with the loss mask gives the loss (and gradient) of the batch without them: they leave
    the denominator as well as the numerator."""
    logps, old, advantages, _, mask = random_batch(0)
    keep = torch.tensor([True, True, False, True, False, True])
    loss, _, _ = policy_loss(logps, old, advantages, loss_mask(mask, keep_sequences=keep), loss_agg=loss_agg)
    loss.backward()
    rows = keep.nonzero().squeeze(-1)
    kept_logps = logps.detach()[rows].requires_grad_()
    expected, _, _ = policy_loss(kept_logps, old[rows], advantages[rows], mask[rows], loss_agg=loss_agg)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logps.grad[rows], kept_logps.grad)
    assert (logps.grad[~keep] == 0).all()


def test_dropped_tokens_leave_the_token_mean_and_the_step_normalizer():
    """Two micro-batches with dropped tokens: with the normalizer counted on the step's loss mask, their losses add
    up to the mean over the kept tokens only (hand-computed: per-token losses -A at the old policy)."""
    action_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep_tokens = torch.tensor([[1, 0, 1], [0, 1, 1]])
    advantages = torch.tensor([[1.0, 5.0, 2.0], [7.0, 3.0, 0.0]])
    mask = loss_mask(action_mask, keep_tokens)
    normalizer = loss_normalizer(mask, "token-mean")
    assert normalizer == 3  # kept tokens: A = 1, 2, 3
    total = 0.0
    for rows in ([0], [1]):
        logps = torch.zeros(1, 3)
        loss, _, _ = policy_loss(logps, logps, advantages[rows], mask[rows], normalizer=normalizer)
        total += loss.item()
    assert total == pytest.approx(-(1.0 + 2.0 + 3.0) / 3)


@pytest.mark.parametrize("loss_of", [policy_loss, gspo_loss, cispo_loss])
def test_an_all_masked_batch_gives_zero_loss_and_zero_gradient(loss_of):
    logps = torch.tensor([[NAN, -1.0], [float("inf"), -2.0]], requires_grad=True)
    old = torch.tensor([[float("-inf"), 0.0], [NAN, -1.0]])
    advantages = torch.tensor([[NAN, 1.0], [2.0, 3.0]])
    mask = loss_mask(torch.ones(2, 2), keep_sequences=torch.tensor([False, False]))
    loss, clip_fraction, approx_kl = loss_of(logps, old, advantages, mask)
    loss.backward()
    assert loss.item() == 0.0 and clip_fraction.item() == 0.0 and approx_kl.item() == 0.0
    assert (logps.grad == 0).all()


# ------------------------------------------------------------------------------------------------------ GSPO
# Row 0: token log-ratios 0.1, -0.3, A = +1. Row 1: 0.3, 0.0, 0.3, A = +2. Row 2: no response, garbage.
GSPO_LOG_RATIOS = torch.tensor([[0.1, -0.3, 0.0], [0.3, 0.0, 0.3], [0.0, 0.0, 0.0]])
GSPO_OLD = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -0.25, -3.0], [NAN, 1.0, float("inf")]])
GSPO_ADVANTAGES = torch.tensor([[1.0, 1.0, NAN], [2.0, 2.0, 2.0], [NAN, 5.0, 5.0]])
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])


def gspo_logps():
    logps = (GSPO_OLD.nan_to_num(0.0, posinf=0.0) + GSPO_LOG_RATIOS).masked_fill(GSPO_MASK == 0, NAN)
    return logps.requires_grad_()


def test_gspo_hand_computed():
    logps = gspo_logps()
    loss, clip_fraction, approx_kl = gspo_loss(logps, GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_eps=0.05,
                                               clip_eps_high=0.05)
    # s_0 = exp((0.1 - 0.3) / 2) = exp(-0.1) = 0.90483742, below 0.95, but with A > 0 the min takes the unclipped
    # term: -min(0.9048 * 1, 0.95 * 1) = -0.90483742. s_1 = exp(0.6 / 3) = exp(0.2) = 1.22140276 > 1.05:
    # -min(2.4428, 1.05 * 2) = -2.1 (clipped). Mean over the two answers: (-0.90483742 - 2.1) / 2.
    torch.testing.assert_close(loss, torch.tensor(-1.50241871))
    # answer 1 clipped: its 3 tokens of 5
    assert clip_fraction.item() == pytest.approx(0.6)
    # k3 per token exp(x) - 1 - x for x = 0.1, -0.3, 0.3, 0, 0.3: 0.00517092 + 0.04081822 + 0.04985881 + 0 +
    # 0.04985881 = 0.14570676, over 5 tokens
    torch.testing.assert_close(approx_kl, torch.tensor(0.02914135))
    loss.backward()
    # Answer 0 unclipped: each token -A s_0 / (|y_0| G) = -0.90483742 / 4, token 0 included although its own ratio
    # exp(0.1) = 1.105 is outside [0.95, 1.05]. Answer 1 clipped: no token gets a gradient, token 1 included
    # although its own ratio is exactly 1.
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.22620935, -0.22620935, 0.0], [0.0, 0.0, 0.0],
                                                         [0.0, 0.0, 0.0]]))
    # PPO on the same tokens clips token (0, 0) by itself: GSPO's decision is the answer's, not the token's.
    ppo_logps = gspo_logps()
    ppo, _, _ = policy_loss(ppo_logps, GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_eps=0.05)
    ppo.backward()
    assert ppo_logps.grad[0, 0] == 0 and ppo_logps.grad[1, 1] != 0


def test_gspo_token_mean_weighs_each_answer_by_its_length():
    loss, _, _ = gspo_loss(gspo_logps(), GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, clip_eps=0.05, clip_eps_high=0.05,
                           loss_agg="token-mean")
    # (2 * -0.90483742 + 3 * -2.1) / 5 tokens
    torch.testing.assert_close(loss, torch.tensor(-1.62193497))


def gspo_reference(logps, old, advantages, mask, eps_low, eps_high, loss_agg, weights=None, token_level=False):
    """GSPO straight from the paper, one answer and one token at a time (autograd through the scalar ops)."""
    total, count = 0.0, 0
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        log_s = sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens)
        s = torch.exp(log_s)
        terms = []
        for t in tokens:
            # GSPO-token: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]
            ratio = s.detach() * torch.exp(logps[i, t]) / torch.exp(logps[i, t]).detach() if token_level else s
            a = advantages[i, t].item()
            term = -torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
            terms.append(term * (1.0 if weights is None else weights[i, t].item()))
        if loss_agg == "seq-mean-token-mean":
            total, count = total + sum(terms) / len(tokens), count + 1
        else:
            total, count = total + sum(terms), count + len(tokens)
    return total / count


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_gspo_matches_the_reference_loop_with_weights(loss_agg, token_level, per_token_advantages):
    logps, old, advantages, sequence_advantages, mask = random_batch(1)
    advantages = advantages if per_token_advantages else sequence_advantages
    weights = torch.rand(logps.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    loss, clip_fraction, _ = gspo_loss(logps, old, advantages, mask, clip_eps=0.03, clip_eps_high=0.05,
                                       loss_agg=loss_agg, token_weights=weights, token_level=token_level)
    assert 0 < clip_fraction.item() < 1  # both branches of the min are exercised
    loss.backward()
    reference_logps = logps.detach().clone().requires_grad_()
    expected = gspo_reference(reference_logps, old, advantages, mask, 0.03, 0.05, loss_agg, weights, token_level)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logps.grad, reference_logps.grad.nan_to_num(0.0))


def test_gspo_all_tokens_of_an_answer_share_one_clipping_decision():
    logps, old, _, advantages, mask = random_batch(3, batch=12, spread=0.2)
    loss, clip_fraction, _ = gspo_loss(logps, old, advantages, mask, clip_eps=0.02, clip_eps_high=0.02)
    assert 0 < clip_fraction.item() < 1
    loss.backward()
    for row in range(12):
        grads = logps.grad[row][mask[row] != 0]
        assert (grads == 0).all() or (grads != 0).all(), row
        if len(grads):  # unclipped: every token the same gradient, -A s / (|y| G)
            torch.testing.assert_close(grads, grads[:1].expand_as(grads))


def test_gspo_token_with_sequence_advantages_is_gspo():
    logps, old, _, advantages, mask = random_batch(4)
    token_logps = logps.detach().clone().requires_grad_()
    loss, clip_fraction, _ = gspo_loss(logps, old, advantages, mask, clip_eps=0.03, clip_eps_high=0.04)
    token_loss, token_clip_fraction, _ = gspo_loss(token_logps, old, advantages, mask, clip_eps=0.03,
                                                   clip_eps_high=0.04, token_level=True)
    assert 0 < clip_fraction.item() < 1
    assert loss.item() == token_loss.item() and clip_fraction.item() == token_clip_fraction.item()
    loss.backward()
    token_loss.backward()
    torch.testing.assert_close(logps.grad, token_logps.grad)


def test_gspo_micro_batches_add_up_to_the_step_mean():
    logps, old, _, advantages, mask = random_batch(5)
    full, _, _ = gspo_loss(logps, old, advantages, mask, clip_eps=0.03)
    normalizer = loss_normalizer(mask, "seq-mean-token-mean")
    assert normalizer == 5  # six answers, one empty
    parts = sum(gspo_loss(logps[rows], old[rows], advantages[rows], mask[rows], clip_eps=0.03,
                          normalizer=normalizer)[0] for rows in ([0, 1, 2], [3, 4, 5]))
    torch.testing.assert_close(parts, full)


def test_gspo_extreme_log_ratios_stay_finite():
    logps = torch.tensor([[100.0, 90.0], [-100.0, -80.0], [0.0, 0.0]], requires_grad=True)
    for token_level in (False, True):
        for advantage in (1.0, -1.0):
            logps.grad = None
            loss, _, approx_kl = gspo_loss(logps, torch.zeros(3, 2), torch.full((3, 2), advantage),
                                           torch.ones(3, 2), token_level=token_level)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(approx_kl) and torch.isfinite(logps.grad).all()


def test_gspo_refuses_a_token_sum_and_bad_arguments():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="not seq-mean-token-sum"):
        gspo_loss(*args, loss_agg="seq-mean-token-sum")
    with pytest.raises(ValueError, match="loss_agg must be one of seq-mean-token-mean, token-mean for GSPO"):
        gspo_loss(*args, loss_agg="sum")
    with pytest.raises(ValueError, match="clip_eps and clip_eps_high must be > 0"):
        gspo_loss(*args, clip_eps=0.0)
    with pytest.raises(ValueError, match=r"token_weights \(2, 2\)"):
        gspo_loss(*args, token_weights=torch.ones(2, 2))


# ----------------------------------------------------------------------------------------------------- CISPO
def test_cispo_hand_computed():
    logps = ppo_logps().detach().masked_fill(MASK == 0, NAN).requires_grad_()
    loss, clip_fraction, approx_kl = cispo_loss(logps, OLD_LOGPS, ADVANTAGES, MASK, clip_eps=0.2)
    # weights clip(r, 0.8, 1.2) of r = 1.5, 0.5, 1.1, 1.0: 1.2, 0.8, 1.1, 1.0; log pi = -1 + log 1.5 = -0.59453489,
    # -2 + log 0.5 = -2.69314718, -0.5 + log 1.1 = -0.40468982, -0.7. Per token -w A log pi: 0.71344187,
    # -2.15451774, 0.89031760, -0.35; sum -0.90075827, over 4 tokens.
    torch.testing.assert_close(loss, torch.tensor(-0.22518957))
    assert clip_fraction.item() == 0.5  # two weights clipped
    torch.testing.assert_close(approx_kl, torch.tensor(0.07309297))  # as PPO's: same ratios
    loss.backward()
    # -w A / 4: the two clipped tokens keep a gradient (PPO gives them 0), scaled by the clipped weight.
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.3, 0.2, -0.55], [0.125, 0.0, 0.0]]))


def cispo_reference(logps, old, advantages, mask, eps_low, eps_high, loss_agg):
    """CISPO straight from the paper, one token at a time: -sg[clip(r_t)] A_t log pi(y_t)."""
    total, count = 0.0, 0
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        terms = []
        for t in tokens:
            ratio = math.exp(logps[i, t].item() - old[i, t].item())
            weight = min(max(ratio, 1 - eps_low), 1 + eps_high)
            terms.append(-weight * advantages[i, t].item() * logps[i, t])
        if loss_agg == "token-mean":
            total, count = total + sum(terms), count + len(tokens)
        elif loss_agg == "seq-mean-token-sum":
            total, count = total + sum(terms), count + 1
        else:
            total, count = total + sum(terms) / len(tokens), count + 1
    return total / count


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_cispo_matches_the_reference_loop(loss_agg):
    logps, old, advantages, _, mask = random_batch(6, spread=0.3)
    loss, clip_fraction, _ = cispo_loss(logps, old, advantages, mask, clip_eps=0.1, clip_eps_high=0.2,
                                        loss_agg=loss_agg)
    assert 0 < clip_fraction.item() < 1
    loss.backward()
    reference_logps = logps.detach().clone().requires_grad_()
    expected = cispo_reference(reference_logps, old, advantages, mask, 0.1, 0.2, loss_agg)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logps.grad, reference_logps.grad.nan_to_num(0.0))
    # every response token keeps a gradient (no advantage here is 0)
    assert (logps.grad[mask != 0] != 0).all()


def test_cispo_on_policy_gradient_is_ppos_and_without_lower_bound_keeps_small_weights():
    logps = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    advantages = torch.tensor([[2.0, -1.0]])
    loss, _, _ = cispo_loss(logps, logps.detach(), advantages, torch.ones(1, 2))
    loss.backward()
    ppo_logps = logps.detach().clone().requires_grad_()
    ppo, _, _ = policy_loss(ppo_logps, ppo_logps.detach(), advantages, torch.ones(1, 2))
    ppo.backward()
    torch.testing.assert_close(logps.grad, ppo_logps.grad)
    # clip_eps >= 1: ratio 0.1 keeps weight 0.1 (only the upper bound acts), ratio 3 is cut to 1.2.
    logps = torch.log(torch.tensor([[0.1, 3.0]])).requires_grad_()
    loss, clip_fraction, _ = cispo_loss(logps, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_eps=1.0,
                                        clip_eps_high=0.2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.1 / 2, -1.2 / 2]]))
    assert clip_fraction.item() == 0.5


def test_cispo_extreme_log_ratios_stay_finite():
    logps = torch.tensor([[100.0, -100.0, 0.0]], requires_grad=True)
    for advantage in (1.0, -1.0):
        logps.grad = None
        loss, _, approx_kl = cispo_loss(logps, torch.zeros(1, 3), torch.full((1, 3), advantage), torch.ones(1, 3))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(approx_kl) and torch.isfinite(logps.grad).all()
