import pytest
import torch

from hpc_rlhf.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from hpc_rlhf.algorithms.dynamic_sampling import dynamic_sampling_figures, fill_batch, uniform_groups


def test_uniform_groups_hand_computed():
    # n = 3: all correct, mixed, all wrong, almost equal (a real difference, however small), -0.0 == 0.0
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5000001, -0.0, 0.0, 0.0])
    assert uniform_groups(scores, 3).tolist() == [True, False, True, False, True]


def test_uniform_groups_are_exactly_those_every_group_estimator_gives_zero_advantage():
    # 0/1 rewards (verifiable tasks) of 5 samples: their means are exact, so the advantages are exactly 0 there.
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (64 * 5,), generator=generator).float()
    uniform = uniform_groups(scores, 5)
    assert uniform.any() and not uniform.all()
    for estimator in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        zero = (estimator(scores, 5).view(-1, 5) == 0).all(-1)
        assert zero.equal(uniform), estimator.__name__


def test_uniform_groups_bad_arguments():
    with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be >= 2"):
        uniform_groups(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"scores must be \(num_prompts \* 3,\)"):
        uniform_groups(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="scores must be finite, got nan at sample 2"):
        uniform_groups(torch.tensor([0.0, 1.0, float("nan"), 1.0]), 2)


def fill_reference(kept_per_round, groups_wanted):
    """First come, first served: walk the rounds in order, each round's prompts in order."""
    chosen = [[False] * len(kept) for kept in kept_per_round]
    for round_index, kept in enumerate(kept_per_round):
        for prompt, keep in enumerate(kept.tolist()):
            if keep and groups_wanted > 0:
                chosen[round_index][prompt] = True
                groups_wanted -= 1
    return chosen


def test_fill_batch_hand_computed():
    rounds = [torch.tensor([True, False, True]), torch.tensor([False, True, True, True]), torch.tensor([True])]
    chosen = fill_batch(rounds, 4)
    # round 0 gives prompts 0 and 2, round 1 prompts 1 and 2 (4 reached), its prompt 3 and round 2 are not needed
    assert [c.tolist() for c in chosen] == [[True, False, True], [False, True, True, False], [False]]
    assert [c.tolist() for c in fill_batch(rounds, 0)] == [[False] * 3, [False] * 4, [False]]
    # not enough: every kept group, the batch stays short
    assert [c.tolist() for c in fill_batch(rounds, 9)] == [[True, False, True], [False, True, True, True], [True]]


def test_fill_batch_matches_the_reference_and_is_a_prefix_of_longer_runs():
    generator = torch.Generator().manual_seed(1)
    rounds = [torch.rand(8, generator=generator) < 0.4 for _ in range(5)]
    for wanted in range(0, 20):
        chosen = fill_batch(rounds, wanted)
        assert [c.tolist() for c in chosen] == fill_reference(rounds, wanted)
        assert sum(int(c.sum()) for c in chosen) == min(wanted, sum(int(k.sum()) for k in rounds))
        # Generating fewer rounds never changes what the earlier rounds give.
        for last in range(len(rounds)):
            fewer = fill_batch(rounds[:last + 1], wanted)
            assert all(a.equal(b) for a, b in zip(fewer, chosen[:last + 1])) or \
                sum(int(c.sum()) for c in fewer) < wanted


def test_fill_batch_bad_arguments():
    with pytest.raises(ValueError, match="groups_wanted must be >= 0"):
        fill_batch([torch.tensor([True])], -1)
    with pytest.raises(ValueError, match=r"kept_per_round\[1\] must be \(num_prompts,\)"):
        fill_batch([torch.tensor([True]), torch.ones(2, 2, dtype=torch.bool)], 1)


def test_dynamic_sampling_figures_hand_computed():
    kept = [torch.tensor([True, False, True, False]), torch.tensor([False, True, True, True])]
    chosen = fill_batch(kept, 4)
    figures = dynamic_sampling_figures(kept, chosen, n=8)
    # 3 of 8 groups uniform; 2 rounds; 64 samples generated for 32 trained: 32 extra per 32 trained
    assert figures == {"groups_filtered_share": 3 / 8, "generation_rounds": 2.0, "extra_samples_per_trained": 1.0}
    nothing = dynamic_sampling_figures([torch.tensor([False, False])], [torch.tensor([False, False])], n=4)
    assert nothing == {"groups_filtered_share": 1.0, "generation_rounds": 1.0, "extra_samples_per_trained": 8.0}
    with pytest.raises(ValueError, match="kept_per_round has 2 rounds but chosen_per_round 1"):
        dynamic_sampling_figures(kept, chosen[:1], n=8)
