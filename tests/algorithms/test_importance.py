import math

import pytest
import torch

from hpc_rlhf.algorithms.choices import DEFAULT_IS_CAP, IS_CORRECTIONS, resolve_is_correction
from hpc_rlhf.algorithms.importance import off_policy_correction, sequence_log_ratio
from hpc_rlhf.algorithms.losses import cispo_loss, gspo_loss, loss_normalizer, policy_loss

NAN, INF = float("nan"), float("inf")

# log pi_old - log mu per token. Row 0: 0.5, 0.5 (sum 1.0). Row 1: 0.2, -0.1, 0.3 (sum 0.4). Row 2: -1.0.
# Row 3: no response. 6 response tokens; padding holds garbage.
LOG_RATIOS = torch.tensor([[0.5, 0.5, 0.0], [0.2, -0.1, 0.3], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -1.0, -1.5], [-3.0, INF, NAN], [NAN, NAN, -INF]],
                       dtype=torch.float64)
OLD = (ROLLOUT.nan_to_num(0.0, posinf=0.0, neginf=0.0) + LOG_RATIOS).masked_fill(MASK == 0, NAN)
E = math.e


def test_sequence_log_ratio_sums_the_response_tokens():
    torch.testing.assert_close(sequence_log_ratio(OLD, ROLLOUT, MASK),
                               torch.tensor([1.0, 0.4, -1.0, 0.0], dtype=torch.float64))


def test_tis_token_hand_computed():
    result = off_policy_correction(OLD, ROLLOUT, MASK, "tis_token", cap=1.3)
    # ratios e^0.5 = 1.64872, 1.64872 | e^0.2 = 1.22140, e^-0.1 = 0.90484, e^0.3 = 1.34986 | e^-1 = 0.36788;
    # truncated at 1.3: the two of row 0 and the last of row 1, 3 of 6 tokens.
    torch.testing.assert_close(result.weights, torch.tensor(
        [[1.3, 1.3, 0.0], [1.22140276, 0.90483742, 1.3], [0.36787944, 0.0, 0.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64))
    assert result.mask.equal(MASK.bool())
    assert result.truncated_share.item() == pytest.approx(0.5) and result.masked_share.item() == 0.0


def test_tis_seq_hand_computed():
    result = off_policy_correction(OLD, ROLLOUT, MASK, "tis_seq", cap=2.0)
    # rho(y) = e^1 = 2.71828 -> 2 (truncated, 2 tokens), e^0.4 = 1.49182, e^-1 = 0.36788; every token its answer's.
    torch.testing.assert_close(result.weights, torch.tensor(
        [[2.0, 2.0, 0.0], [1.49182470, 1.49182470, 1.49182470], [0.36787944, 0.0, 0.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64))
    assert result.mask.equal(MASK.bool())
    assert result.truncated_share.item() == pytest.approx(2 / 6) and result.masked_share.item() == 0.0


def test_mis_token_hand_computed():
    result = off_policy_correction(OLD, ROLLOUT, MASK, "mis_token", is_low=0.5, is_high=1.3)
    # kept in [0.5, 1.3]: 1.22140 and 0.90484 of row 1; dropped: 1.64872 (x2), 1.34986, 0.36788 -> 4 of 6.
    torch.testing.assert_close(result.weights, torch.tensor(
        [[0.0, 0.0, 0.0], [1.22140276, 0.90483742, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert result.mask.equal(torch.tensor([[0, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]).bool())
    assert result.masked_share.item() == pytest.approx(4 / 6) and result.truncated_share.item() == 0.0


def test_mis_seq_hand_computed():
    result = off_policy_correction(OLD, ROLLOUT, MASK, "mis_seq", is_low=0.5, is_high=2.0)
    # rho(y) = 2.71828 > 2 dropped (2 tokens), 1.49182 kept, 0.36788 < 0.5 dropped (1 token): 3 of 6 dropped.
    torch.testing.assert_close(result.weights, torch.tensor(
        [[0.0, 0.0, 0.0], [1.49182470, 1.49182470, 1.49182470], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        dtype=torch.float64))
    assert result.mask.equal(torch.tensor([[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]).bool())
    assert result.masked_share.item() == pytest.approx(0.5) and result.truncated_share.item() == 0.0
    # is_low = 0: no lower bound, row 2 comes back
    assert off_policy_correction(OLD, ROLLOUT, MASK, "mis_seq", is_low=0.0, is_high=2.0).mask[2, 0]


def test_masked_is_bounds_are_inclusive():
    # log-ratios exactly log 0.5 and log 2 sit on the bounds and are kept; a hair outside either is dropped.
    old = torch.tensor([[math.log(0.5), math.log(2.0), math.log(2.0) + 1e-9, math.log(0.5) - 1e-9]],
                       dtype=torch.float64)
    result = off_policy_correction(old, torch.zeros_like(old), torch.ones(1, 4), "mis_token", is_low=0.5, is_high=2.0)
    assert result.mask.tolist() == [[True, True, False, False]]
    torch.testing.assert_close(result.weights, torch.tensor([[0.5, 2.0, 0.0, 0.0]], dtype=torch.float64))


def test_none_keeps_everything():
    result = off_policy_correction(OLD, ROLLOUT, MASK, "none")
    assert result.weights is None and result.mask.equal(MASK.bool())
    assert result.masked_share.item() == 0.0 and result.truncated_share.item() == 0.0


def reference(old, rollout, mask, mode, cap=None, is_low=None, is_high=None):
    """The corrections from their definitions, one token at a time, the sequence ratio as a plain product of
    token ratios. Returns (weights, kept, masked share, truncated share) as Python lists and floats."""
    batch, seq = mask.shape
    weights = [[0.0] * seq for _ in range(batch)]
    kept = [[False] * seq for _ in range(batch)]
    tokens = masked = truncated = 0
    for i in range(batch):
        positions = [t for t in range(seq) if mask[i, t]]
        ratios = {t: math.exp(old[i, t].item() - rollout[i, t].item()) for t in positions}
        sequence_ratio = math.prod(ratios.values())
        for t in positions:
            tokens += 1
            rho = ratios[t] if mode.endswith("_token") else sequence_ratio
            if mode.startswith("tis_"):
                weights[i][t], kept[i][t] = min(rho, cap), True
                truncated += rho > cap
            elif is_low <= rho <= is_high:
                weights[i][t], kept[i][t] = rho, True
            else:
                masked += 1
    return weights, kept, masked / max(tokens, 1), truncated / max(tokens, 1)


def random_logps(seed, batch=8, seq=9, spread=0.3, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, seq, generator=generator, dtype=dtype) * 4
    old = rollout + torch.randn(batch, seq, generator=generator, dtype=dtype) * spread
    lengths = torch.randint(0, seq + 1, (batch,), generator=generator)
    lengths[0] = 0
    mask = torch.arange(seq) < lengths.unsqueeze(-1)
    return old.masked_fill(~mask, INF), rollout.masked_fill(~mask, NAN), mask


@pytest.mark.parametrize("mode, params", [("tis_token", {"cap": 1.2}), ("tis_seq", {"cap": 1.5}),
                                          ("mis_token", {"is_low": 0.8, "is_high": 1.25}),
                                          ("mis_seq", {"is_low": 0.5, "is_high": 2.0})])
def test_every_mode_matches_the_reference_loop(mode, params):
    old, rollout, mask = random_logps(0)
    result = off_policy_correction(old, rollout, mask, mode, **params)
    weights, kept, masked_share, truncated_share = reference(old, rollout, mask, mode, **params)
    torch.testing.assert_close(result.weights, torch.tensor(weights, dtype=torch.float64))
    assert result.mask.equal(torch.tensor(kept))
    assert result.masked_share.item() == pytest.approx(masked_share)
    assert result.truncated_share.item() == pytest.approx(truncated_share)
    # the case is not trivial: something is truncated or masked, and something is not
    share = truncated_share if mode.startswith("tis_") else masked_share
    assert 0 < share < 1


def test_tis_token_is_bit_for_bit_the_recipes_truncated_importance_sampling():
    """The recipe's weights are torch.exp(old - rollout).clamp(max=cap) and its tis_clipped the share of tokens
    whose weight exceeds the cap: the same weights, loss, gradient and share, bit for bit, in fp32."""
    old, rollout, mask = random_logps(1, spread=1.0, dtype=torch.float32)
    old[2, 0], old[3, 1] = rollout[2, 0] + 60.0, rollout[3, 1] - 60.0  # extreme ratios too
    result = off_policy_correction(old, rollout, mask, "tis_token", cap=2.0)
    recipe = torch.exp(old - rollout).clamp(max=2.0)
    assert torch.equal(result.weights[mask], recipe[mask])
    tokens = mask.sum().clamp(min=1)
    assert result.truncated_share.item() == ((torch.exp(old - rollout) * mask > 2.0).sum() / tokens).item()
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    losses = []
    for weights in (result.weights, recipe):
        logps = (old + 0.05).masked_fill(~mask, 0).requires_grad_()
        loss, _, _ = policy_loss(logps, old, advantages, mask, token_weights=weights)
        loss.backward()
        losses.append((loss, logps.grad))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


@pytest.mark.parametrize("mode, params", [("tis_token", {"cap": 2.0}), ("tis_seq", {"cap": 2.0}),
                                          ("mis_token", {"is_low": 0.5, "is_high": 2.0}),
                                          ("mis_seq", {"is_low": 0.0, "is_high": 2.0})])
def test_extreme_log_ratios_give_finite_weights(mode, params):
    """Rows of 50 tokens at log-ratio +-30: the sequence ratio is e^+-1500, past fp64's range; fp32 token ratios
    overflow at e^89. Nothing here may become inf or NaN."""
    rollout = torch.zeros(3, 50)
    old = torch.stack([torch.full((50,), 30.0), torch.full((50,), -30.0), torch.full((50,), 100.0)])
    result = off_policy_correction(old, rollout, torch.ones(3, 50), mode, **params)
    assert torch.isfinite(result.weights).all()
    assert torch.isfinite(result.masked_share) and torch.isfinite(result.truncated_share)
    if mode == "tis_seq":
        assert result.weights[0].eq(2.0).all() and result.weights[1].eq(0.0).all()
    if mode == "mis_seq":  # too large: dropped; e^-1500 with no lower bound: kept, with weight 0
        assert not result.mask[0].any() and result.mask[1].all() and result.weights[1].eq(0.0).all()


@pytest.mark.parametrize("mode", IS_CORRECTIONS)
def test_empty_responses_and_an_empty_batch(mode):
    _, params = resolve_is_correction(mode)
    for mask in (torch.zeros(2, 3, dtype=torch.bool), torch.zeros(0, 3, dtype=torch.bool)):
        old = torch.full(mask.shape, NAN)
        result = off_policy_correction(old, old, mask, mode, **params)
        assert not result.mask.any()
        assert result.masked_share.item() == 0.0 and result.truncated_share.item() == 0.0
        if result.weights is not None:
            assert result.weights.eq(0).all()


@pytest.mark.parametrize("loss_of", [policy_loss, gspo_loss, cispo_loss])
def test_masked_tokens_contribute_nothing_to_any_policy_loss(loss_of):
    """What the loss sees of masked IS: the kept tokens, weighted, over the kept tokens' normalizer. Changing the
    dropped tokens' log-probs, advantages or ratios changes neither the loss nor its gradient."""
    old, rollout, mask = random_logps(3)
    result = off_policy_correction(old, rollout, mask, "mis_token", is_low=0.8, is_high=1.25)
    assert 0 < result.masked_share.item() < 1
    dropped = mask & ~result.mask
    outputs = []
    for noise in (0.0, 5.0):
        logps = (old.masked_fill(~mask, 0) + 0.01 + noise * dropped).requires_grad_()
        advantages = torch.ones(old.shape, dtype=old.dtype) + noise * dropped
        loss, _, _ = loss_of(logps, old, advantages, result.mask, token_weights=result.weights,
                             normalizer=loss_normalizer(result.mask, "token-mean"), loss_agg="token-mean")
        loss.backward()
        assert (logps.grad[dropped] == 0).all()
        outputs.append((loss, logps.grad))
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    torch.testing.assert_close(outputs[0][1], outputs[1][1])


def test_bad_arguments():
    args = (OLD, ROLLOUT, MASK)
    with pytest.raises(ValueError, match="mode must be one of none, tis_token"):
        off_policy_correction(*args, "auto")
    with pytest.raises(ValueError, match="tis_seq needs a finite cap > 0"):
        off_policy_correction(*args, "tis_seq")
    with pytest.raises(ValueError, match="cap applies to tis_token and tis_seq, not mis_seq"):
        off_policy_correction(*args, "mis_seq", cap=2.0, is_low=0.5, is_high=2.0)
    with pytest.raises(ValueError, match="is_low and is_high apply to mis_token and mis_seq, not tis_token"):
        off_policy_correction(*args, "tis_token", cap=2.0, is_high=2.0)
    with pytest.raises(ValueError, match="mis_token needs 0 <= is_low < 1 < is_high"):
        off_policy_correction(*args, "mis_token", is_low=1.2, is_high=2.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        off_policy_correction(OLD, ROLLOUT[:, :2], MASK, "none")


# ------------------------------------------------------------------------------------------------ resolver
# (the resolver itself: tests/algorithms/test_choices.py)
def test_explicit_modes_and_their_defaults():
    assert resolve_is_correction("none") == ("none", {})
    assert resolve_is_correction("none", None, 3) == ("none", {})  # explicit: off even with stale batches
    assert resolve_is_correction("tis_token") == ("tis_token", {"cap": 2.0})
    assert resolve_is_correction("tis_seq", 5.0) == ("tis_seq", {"cap": 5.0})
    assert resolve_is_correction("mis_token") == ("mis_token", {"is_low": 0.5, "is_high": 2.0})
    assert resolve_is_correction("mis_seq", is_high=4.0) == ("mis_seq", {"is_low": 0.25, "is_high": 4.0})
    assert resolve_is_correction("mis_seq", is_low=0.0, is_high=3.0) == ("mis_seq", {"is_low": 0.0, "is_high": 3.0})
    for mode in IS_CORRECTIONS:  # what the resolver gives, the correction takes
        resolved, params = resolve_is_correction(mode)
        off_policy_correction(OLD, ROLLOUT, MASK, resolved, **params)
