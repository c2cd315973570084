"""The data the RL phases hand each other (rl/batches.py): shards, the padded batch, ragged and dense per-token
values, and the Experience's selection of rows."""

import torch

from hpc_rlhf.rl.batches import from_ragged, make_batch, response_logprobs, shard_bounds, to_ragged


def test_shard_bounds_cover_everything_in_order():
    for count in (0, 1, 7, 16):
        for parts in (1, 2, 3, 5):
            bounds = [shard_bounds(count, parts, i) for i in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_make_batch_layout_and_action_mask():
    batch = make_batch([[1, 5, 6], [1, 7]], [torch.tensor([8, 2]), torch.tensor([9, 9, 2])], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    # position t predicts token t+1: sample 0's response tokens sit at 3, 4 -> predicted from 2, 3
    assert batch.action_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_ragged_round_trip_puts_values_on_response_positions():
    batch = make_batch([[1, 5, 6], [1]], [torch.tensor([8, 2]), torch.tensor([4, 4, 4, 2])], pad_id=0)
    seqs = [torch.tensor([0.5, -1.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])]
    dense = from_ragged(seqs, batch)
    assert dense[0].tolist() == [0, 0, 0.5, -1.0] and dense[1].tolist() == [1, 2, 3, 4]
    assert [t.tolist() for t in to_ragged(dense, batch)] == [s.tolist() for s in seqs]


def test_response_logprobs_score_the_next_token():
    batch = make_batch([[1, 2]], [torch.tensor([3])], pad_id=0)
    logits = torch.zeros(1, 3, 5)
    logits[0, 1, 3] = 2.0  # position 1 predicts token 3 (the response)
    lp = response_logprobs(logits, batch)
    expected = 2.0 - torch.logsumexp(torch.tensor([0, 0, 0, 2.0, 0]), 0)
    assert torch.isclose(lp[0, 1], expected)


def test_experience_select_cuts_rows_to_their_width():
    from hpc_rlhf.rl.batches import Experience

    batch = make_batch([[1, 5], [1]], [torch.tensor([8]), torch.tensor([4, 4, 4, 2])], pad_id=0)
    per_token = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    exp = Experience(batch, torch.tensor([1.0, 2.0]), per_token, per_token, per_token, per_token, per_token,
                     batch.action_mask)
    first = exp.select([0])
    assert first.batch.input_ids.tolist() == [[1, 5, 8]] and first.batch.action_mask.tolist() == [[0, 1]]
    assert first.old_logps.tolist() == [[0.0, 1.0]] and first.scores.tolist() == [1.0] and first.values is None
    assert first.loss_mask.tolist() == [[0, 1]] and first.is_weights is None
    assert exp.tokens([0, 1]) == 5.0 and len(exp) == 2


def test_every_per_sample_field_of_the_experience_is_selected():
    """A micro-batch selects every field but the batch by name (PER_SAMPLE_FIELDS): a field added to Experience and
    left out of the list would reach the loss unselected."""
    import dataclasses

    from hpc_rlhf.rl.batches import PER_SAMPLE_FIELDS, Experience

    assert [f.name for f in dataclasses.fields(Experience)] == ["batch", *PER_SAMPLE_FIELDS]
