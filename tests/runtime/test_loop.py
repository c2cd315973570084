"""The one-model training loop (hpc_rlhf/runtime/loop.py)."""

from __future__ import annotations

import math

from hpc_rlhf.data import order
from hpc_rlhf.engines.train import StepInfo
from hpc_rlhf.runtime import checkpointing, loop
from hpc_rlhf.utils import checkpoint as ckpt
from hpc_rlhf.utils.metrics import MetricsLogger, read_metrics
from tests.recipes import FakeEngine, a_run, one_rank_world


def test_step_micro_batches_share_the_step_between_ranks(tmp_path):
    settings = ("train.batch_size=8", "train.micro_batch_size=2", "train.seed=7")
    ranks = [loop.step_micro_batches(a_run(tmp_path, *settings, rank=r, world_size=2), 20, 3) for r in (0, 1)]
    assert all(len(micro) == 2 and all(len(m) == 2 for m in micro) for micro in ranks)
    rows = [i for micro in ranks for m in micro for i in m]
    assert rows == order.step_indices(20, 8, 3, 7)
    assert loop.step_micro_batches(a_run(tmp_path, *settings, rank=0, world_size=2), 20, 4) != ranks[0]


def test_grouped_by_length_each_rank_cuts_its_own_rows_sorted_by_length(tmp_path):
    """train.group_by_length: the same rows on each rank and as many micro-batches of the same size, sorted by
    length, so that each pads to less; without the key the lengths are not read."""
    lengths = {row: (row * 7) % 11 + 1 for row in range(40)}
    settings = ("train.batch_size=16", "train.micro_batch_size=2")
    for rank in (0, 1):
        plain = loop.step_micro_batches(a_run(tmp_path, *settings, rank=rank, world_size=2), 40, 3, lengths.get)
        assert plain == loop.step_micro_batches(a_run(tmp_path, *settings, rank=rank, world_size=2), 40, 3)
        grouped = loop.step_micro_batches(a_run(tmp_path, *settings, "train.group_by_length=true", rank=rank,
                                                world_size=2), 40, 3, lengths.get)
        assert sorted(sum(grouped, [])) == sorted(sum(plain, [])) and [len(m) for m in grouped] == [2] * 4
        assert [lengths[row] for row in sum(grouped, [])] == sorted(lengths[row] for row in sum(plain, []))

        def padded(micro_batches):
            return sum(len(m) * max(lengths[row] for row in m) for m in micro_batches)

        assert padded(grouped) < padded(plain)


def test_step_figures():
    guard = checkpointing.NonFiniteGuard(max_in_a_row=5)
    guard.update(True, 1)
    guard.update(False, 2)
    figures = loop.step_figures(StepInfo(stepped=True, grad_norm=0.5, lr=1e-3), 1000, 4.0, guard)
    assert figures == {"lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 250.0, "skipped_steps": 1}
    assert list(figures) == ["lr", "grad_norm", "tokens_per_s", "skipped_steps"]  # the order of metrics.jsonl
    assert math.isfinite(loop.step_figures(StepInfo(True, None, 0.0), 10, 0.0, guard)["tokens_per_s"])


def test_start_training_resumes_before_opening_the_logger(tmp_path):
    one_rank_world()
    run = a_run(tmp_path, "checkpoint.resume=true", "train.max_steps=10", "train.max_bad_steps=4")
    engine = FakeEngine()
    checkpointing.save_checkpoint(run, 3, {"model": engine})
    old = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    for step in range(1, 6):  # rows of steps 4 and 5 belong to work the resumed run redoes
        old.log(step, {"loss": float(step)})
    old.close()

    bad_steps, stop = loop.start_training(run, {"model": engine})
    assert run.start_step == 3
    assert engine.calls[-1] == ("load_checkpoint", ckpt.checkpoints_root(tmp_path) / ckpt.checkpoint_name(3) / "model")
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    assert isinstance(stop, checkpointing.StopSignal) and not stop.requested()
    assert (bad_steps.what, bad_steps.max_in_a_row, bad_steps.total) == ("sft", 4, 0)
    run.logger.log(4, {"loss": 0.5})
    run.logger.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_finish_training_saves_final_and_closes_the_logger(tmp_path):
    one_rank_world()
    run = a_run(tmp_path)
    engine = FakeEngine()
    run.logger = engine  # records close()
    loop.finish_training(run, engine, tokenizer="the tokenizer")
    assert engine.calls == [("save_hf", tmp_path / "final", "the tokenizer"), ("close",)]
