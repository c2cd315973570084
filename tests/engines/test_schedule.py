import math

import pytest
import torch

from hpc_rlhf.engines.schedule import warmup_cosine, warmup_cosine_scheduler


@pytest.mark.parametrize("step, expected", [
    (0, 0.25),   # warmup 4: (0 + 1) / 4
    (1, 0.5),
    (3, 1.0),    # last warmup step reaches the peak
    (4, 1.0),    # cosine starts at the peak
    (6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # 2 of 8 decay steps done: 0.868198
    (8, 0.55),   # half way: 0.1 + 0.9 * 0.5
    (12, 0.1),   # max_steps: the floor
    (20, 0.1),   # and it stays there
])
def test_warmup_cosine_hand_computed(step, expected):
    assert warmup_cosine(step, warmup_steps=4, max_steps=12, min_lr_ratio=0.1) == pytest.approx(expected, abs=1e-12)


def test_no_warmup_starts_at_peak_and_min_ratio_zero_ends_at_zero():
    assert warmup_cosine(0, 0, 10, 0.0) == 1.0
    assert warmup_cosine(5, 0, 10, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(10, 0, 10, 0.0) == pytest.approx(0.0, abs=1e-12)


def test_warmup_longer_than_training_stays_at_peak_after_warmup():
    assert warmup_cosine(1, 4, 3, 0.1) == 0.5
    assert warmup_cosine(5, 4, 3, 0.1) == 1.0


@pytest.mark.parametrize("args", [(0, -1, 10, 0.1), (0, 2, 0, 0.1), (0, 2, 10, 1.5), (0, 2, 10, -0.1)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError, match="warmup_cosine"):
        warmup_cosine(*args)


def test_scheduler_sets_peak_times_factor_before_each_step():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=2.0)
    scheduler = warmup_cosine_scheduler(optimizer, warmup_steps=2, max_steps=6, min_lr_ratio=0.2)
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # factors: 1/2, 2/2, then cosine over 4 steps from 1 to 0.2: 1, 0.2+0.8*(1+cos(pi/4))/2, 0.6, ..., 0.2
    expected = [1.0, 2.0, 2.0, 2.0 * (0.2 + 0.4 * (1 + math.cos(math.pi / 4))), 1.2,
                2.0 * (0.2 + 0.4 * (1 + math.cos(3 * math.pi / 4))), 0.4, 0.4]
    assert seen == pytest.approx(expected, abs=1e-12)
