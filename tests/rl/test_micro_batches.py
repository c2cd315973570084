"""Micro-batches by samples or by tokens (rl.micro_batch_tokens), on hand-computed cases."""

from __future__ import annotations

import pytest

from hpc_rlhf.rl import micro_batches
from hpc_rlhf.rl.packed import processed_tokens


def test_by_samples_the_cuts_are_fixed_counts_the_last_one_short():
    assert micro_batches.cuts([5, 5, 5, 5, 5], 2) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batches.cuts([], 2) == []


def test_by_tokens_each_cut_takes_what_fits_and_a_longer_sample_goes_alone():
    # 3 | 9 (3 + 9 > 10) | 2 + 2 | 30 (over the budget: alone) | 1
    assert micro_batches.cuts([3, 9, 2, 2, 30, 1], 4, tokens=10) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]
    # the sample count is not a bound then: ten 1-token samples fit one micro-batch of 10 tokens
    assert micro_batches.cuts([1] * 10, 2, tokens=10) == [(0, 10)]
    assert micro_batches.cuts([4, 6, 5, 5], 1, tokens=10) == [(0, 2), (2, 4)]


def test_a_replica_with_fewer_cuts_halves_its_widest_ones_until_it_has_as_many_as_its_peers():
    assert micro_batches.split_to([(0, 3), (3, 4)], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert micro_batches.split_to([(0, 5)], 2) == [(0, 3), (3, 5)]
    assert micro_batches.split_to([(0, 2), (2, 4)], 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="2 samples cannot make 3 micro-batches"):
        micro_batches.split_to([(0, 1), (1, 2)], 3)


def test_every_replica_runs_the_passes_of_the_one_that_needs_the_most():
    # [1, 2, 3] fits one micro-batch of 10 tokens; [9, 9, 9] needs three
    assert micro_batches.passes([[1, 2, 3], [9, 9, 9]], 2, tokens=10) == 3
    assert micro_batches.passes([[1, 2, 3], [9, 9, 9]], 2) == 2
    assert micro_batches.passes([[], [1]], 4) == 1


def test_the_pad_share_follows_the_micro_batches_by_tokens():
    lengths = [2, 8, 2, 8]
    # by two samples: [2, 8] and [2, 8], each padded to 8
    assert processed_tokens(lengths, 2, padding_free=False) == 32
    # by 10 tokens: the same two micro-batches; by 8: 2 | 8 | 2 | 8, no padding
    assert processed_tokens(lengths, 2, padding_free=False, micro_tokens=10) == 32
    assert processed_tokens(lengths, 2, padding_free=False, micro_tokens=8) == 20


@pytest.mark.parametrize("bad", [(0, 0), (1, -1)])
def test_nonsense_budgets_are_refused(bad):
    samples, tokens = bad
    with pytest.raises(ValueError, match="micro-batches of"):
        micro_batches.cuts([1, 2], samples, tokens)
