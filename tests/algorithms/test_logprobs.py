import math

import pytest
import torch

from hpc_rlhf.algorithms.logprobs import (entropy_from_logits, masked_mean, masked_sum, masked_whiten,
                                          sequence_logprob, token_logprobs)


def naive_logprobs(logits, labels, temperature=1.0):
    """The obvious full-size computation, as an independent reference."""
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------- token_logprobs
def test_token_logprobs_hand_computed():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]])
    labels = torch.tensor([[2, 1, 0]])
    # log softmax: z_y - log(e^1 + e^2 + e^3) = z_y - 3.40760596; a uniform row gives -log 3.
    expected = torch.tensor([[-0.40760596, -1.09861229, -2.40760596]])
    got = token_logprobs(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


def test_temperature_divides_the_logits():
    # logits / 2 turns [2, 4, 6] into [1, 2, 3]: the first case above.
    got = token_logprobs(torch.tensor([[2.0, 4.0, 6.0]]), torch.tensor([2]), temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([-0.40760596]))


@pytest.mark.parametrize("chunk_elements", [1, 7, 40, 1 << 24])
def test_chunked_matches_full_log_softmax_on_noncontiguous_input(chunk_elements):
    torch.manual_seed(0)
    full = torch.randn(3, 9, 13) * 4
    logits = full[:, :-1]  # the shifted view a caller passes: not contiguous
    labels = torch.randint(0, 13, (3, 8))
    got = token_logprobs(logits, labels, temperature=0.7, chunk_elements=chunk_elements)
    torch.testing.assert_close(got.double(), naive_logprobs(logits, labels, 0.7), atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_fp32_logprobs_close_to_fp32_reference():
    torch.manual_seed(1)
    logits = (torch.randn(2, 5, 50) * 3).bfloat16()
    labels = torch.randint(0, 50, (2, 5))
    got = token_logprobs(logits, labels, chunk_elements=100)
    assert got.dtype == torch.float32
    # The reference sees exactly the same (bf16-rounded) values, so only fp32 rounding separates them.
    torch.testing.assert_close(got.double(), naive_logprobs(logits.float(), labels), atol=1e-5, rtol=1e-5)


def test_gradient_matches_autograd_through_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 10, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (2, 6))
    weights = torch.randn(2, 6, dtype=torch.float64)
    (token_logprobs(logits, labels, 0.8, chunk_elements=25) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    (naive_logprobs(logits, labels, 0.8) * weights).sum().backward()
    torch.testing.assert_close(ours, logits.grad)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, 0.8, chunk_elements=25), (logits,))


def test_gradient_of_bf16_logits_is_bf16():
    logits = torch.randn(1, 4, 8).bfloat16().requires_grad_()
    token_logprobs(logits, torch.tensor([[0, 1, 2, 3]])).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # d/dz sum_t log softmax(z_t)[y_t]: each position's gradient sums to 1 - 1 = 0.
    torch.testing.assert_close(logits.grad.float().sum(-1), torch.zeros(1, 4), atol=2e-2, rtol=0)


def test_length_one_and_empty_sequences():
    got = token_logprobs(torch.tensor([[[0.0, math.log(3.0)]]]), torch.tensor([[1]]))
    torch.testing.assert_close(got, torch.tensor([[math.log(0.75)]]))
    assert token_logprobs(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0)


def test_bad_labels_are_refused_with_a_clear_error():
    logits = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="labels shape"):
        token_logprobs(logits, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids in \[0, 4\).*-100"):
        token_logprobs(logits, torch.tensor([[1, -100]]))
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logits, torch.tensor([[1, 4]]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, torch.tensor([[1, 2]]), temperature=0.0)


# ---------------------------------------------------------------------------------------------- entropy
def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, -1e4], [5.0, 5.0, 5.0, 5.0]]])
    # uniform over 4: log 4; softmax([1, 2, 3]) (the -1e4 logit has probability 0): -sum p log p = 0.83239558.
    expected = torch.tensor([[math.log(4), 0.83239558, math.log(4)]])
    torch.testing.assert_close(entropy_from_logits(logits, chunk_elements=4), expected)


def test_entropy_matches_definition_and_has_gradient():
    torch.manual_seed(3)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(logits, -1)
    expected = -(probs * probs.log()).sum(-1)
    got = entropy_from_logits(logits, chunk_elements=14)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------- masked reductions
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [0, 0, 0]])


def test_masked_sum_and_mean_hand_computed():
    assert masked_sum(X, MASK).item() == 3.0
    assert masked_mean(X, MASK).item() == 1.5
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 0.0]))
    # The all-masked row gives 0, not 0/0.
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(masked_mean(X, MASK.bool(), dim=0), torch.tensor([1.0, 2.0, 0.0]))


def test_masked_mean_with_float_weights():
    weights = torch.tensor([[0.5, 1.5, 0.0], [0.0, 0.0, 2.0]])
    # (0.5*1 + 1.5*2 + 2*6) / (0.5 + 1.5 + 2) = 15.5 / 4
    assert masked_mean(X, weights).item() == pytest.approx(3.875)


def test_garbage_under_the_mask_reaches_neither_value_nor_gradient():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, True]])
    mean = masked_mean(x, mask)
    assert mean.item() == 1.5
    mean.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.5, 0.0], [0.0, 0.5]]))


def test_masked_mean_shape_mismatch_names_the_arguments():
    with pytest.raises(ValueError, match=r"x has shape \(2, 3\).*mask \(2, 2\)"):
        masked_mean(X, MASK[:, :2])


def test_masked_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # mean 2, population variance (1 + 0 + 1) / 3 = 2/3, 1/sqrt(2/3) = 1.22474487.
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.22474487, 0.0], [1.22474487, 0.0]]))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False),
                               torch.tensor([[0.77525513, 2.0], [3.22474487, 0.0]]))


def test_masked_whiten_single_token_and_constant_values_give_zero():
    torch.testing.assert_close(masked_whiten(torch.tensor([[7.0, 3.0]]), torch.tensor([[0, 1]])),
                               torch.zeros(1, 2))
    torch.testing.assert_close(masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3)), torch.zeros(2, 3))


def test_sequence_logprob_sum_and_average():
    token_logps = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0], [-9.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_logprob(token_logps, mask), torch.tensor([-3.0, -0.5, 0.0]))
    torch.testing.assert_close(sequence_logprob(token_logps, mask, average=True), torch.tensor([-1.5, -0.5, 0.0]))
