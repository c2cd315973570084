import pytest
import torch

from hpc_rlhf.algorithms.losses import loss_mask, loss_normalizer, policy_loss
from hpc_rlhf.algorithms.overlong import overlong_penalty, truncated_responses, truncated_share


def test_overlong_penalty_hand_computed():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - L) / 4, -1 at 10 (and beyond); factor 0.5.
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]) * 0.5
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), expected)


def dapo_reference(length, l_max, l_cache, factor):
    """DAPO's R_length, case by case as the paper writes it."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache * factor
    return -factor


@pytest.mark.parametrize("max_new_tokens, buffer, factor", [(32, 8, 1.0), (20, 20, 0.3), (17, 1, 2.0)])
def test_overlong_penalty_matches_the_reference(max_new_tokens, buffer, factor):
    lengths = torch.arange(0, max_new_tokens + 3)
    expected = [dapo_reference(length, max_new_tokens, buffer, factor) for length in lengths.tolist()]
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens, buffer, factor), torch.tensor(expected))


def test_overlong_penalty_bad_arguments():
    with pytest.raises(ValueError, match=r"overlong_buffer must be in \[1, max_new_tokens=8\], got 9"):
        overlong_penalty(torch.tensor([1]), 8, 9)
    with pytest.raises(ValueError, match="overlong_buffer must be in"):
        overlong_penalty(torch.tensor([1]), 8, 0)
    with pytest.raises(ValueError, match="penalty_factor must be >= 0"):
        overlong_penalty(torch.tensor([1]), 8, 4, -1.0)
    with pytest.raises(ValueError, match=r"response_lens must be \(batch,\)"):
        overlong_penalty(torch.ones(2, 2), 8, 4)


def test_truncated_responses_hand_computed():
    # max_new_tokens = 4, stop tokens 2 and 5: at the limit without a stop (cut), at the limit ending with a stop
    # (complete), shorter without a stop token at its end (cannot happen from an engine, but is not cut), empty.
    lengths = torch.tensor([4, 4, 4, 3, 0])
    last_tokens = torch.tensor([9, 2, 5, 9, 0])
    truncated = truncated_responses(lengths, last_tokens, [2, 5], 4)
    assert truncated.tolist() == [True, False, False, False, False]
    assert truncated_share(truncated).item() == pytest.approx(1 / 5)
    assert truncated_share(torch.zeros(0, dtype=torch.bool)).item() == 0.0


def test_truncated_responses_bad_arguments():
    with pytest.raises(ValueError, match="response 1 has 5 tokens, more than max_new_tokens=4"):
        truncated_responses(torch.tensor([4, 5]), torch.tensor([1, 1]), [2], 4)
    with pytest.raises(ValueError, match="response_lens and last_tokens must both be"):
        truncated_responses(torch.tensor([4, 4]), torch.tensor([1]), [2], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        truncated_responses(torch.tensor([0]), torch.tensor([1]), [2], 0)


def test_the_overlong_filter_drops_cut_answers_from_the_loss_and_its_mean():
    # Answer 0 is cut (4 tokens, no stop); answer 1 (2 tokens, A = 3) is complete. At the old policy each token's
    # loss is -A: the filtered mean is -3 over answer 1's two tokens only, not (-3 * 2) / 6.
    action_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    truncated = truncated_responses(torch.tensor([4, 2]), torch.tensor([7, 2]), [2], 4)
    mask = loss_mask(action_mask, keep_sequences=~truncated)
    assert loss_normalizer(mask, "token-mean") == 2
    logps = torch.zeros(2, 4, requires_grad=True)
    advantages = torch.tensor([[10.0] * 4, [3.0, 3.0, 0.0, 0.0]])
    loss, _, _ = policy_loss(logps, logps.detach(), advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert (logps.grad[0] == 0).all()
