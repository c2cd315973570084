"""Which rows a step trains on (hpc_rlhf.data.order): every row once per epoch, whatever the number of ranks, and
across a resume on another number of ranks (issue 36, point 3)."""

from __future__ import annotations

import collections

import pytest

from hpc_rlhf.data.order import rank_micro_batches, step_indices

ROWS, BATCH, SEED = 96, 12, 5  # 8 steps an epoch


def rows_trained(steps: range, world: int, micro_batch_size: int) -> list[int]:
    """Every row that the ranks of a `world`-rank role train on in `steps`, in micro-batches."""
    return [row for step in steps for rank in range(world)
            for micro in rank_micro_batches(step_indices(ROWS, BATCH, step, SEED), rank, world, micro_batch_size)
            for row in micro]


@pytest.mark.parametrize("before, after", [(2, 1), (2, 3), (4, 6), (1, 4)])
def test_an_epoch_switched_to_another_number_of_ranks_midway_sees_each_row_once(before, after):
    # Steps 0-2 on `before` ranks, a checkpoint, then steps 3-7 on `after` ranks (micro-batches re-cut for them).
    seen = rows_trained(range(0, 3), before, 2) + rows_trained(range(3, 8), after, 2)
    assert sorted(seen) == list(range(ROWS))
    # ... the same rows, step for step, as a run that never changed its size
    assert [sorted(rows_trained(range(s, s + 1), before, 2)) for s in range(3, 8)] == \
        [sorted(rows_trained(range(s, s + 1), after, 2)) for s in range(3, 8)]


def test_the_next_epoch_is_another_order_of_every_row():
    first, second = rows_trained(range(0, 8), 2, 3), rows_trained(range(8, 16), 3, 2)
    assert sorted(first) == sorted(second) == list(range(ROWS))
    assert first != second
    # a batch that straddles two epochs (96 rows, batches of 36) still takes each row of each epoch once
    stream = [row for step in range(8) for row in step_indices(ROWS, 36, step, SEED)]
    assert all(count == 3 for count in collections.Counter(stream).values())
