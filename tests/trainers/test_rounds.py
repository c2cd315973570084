"""The round machinery of `rs` and `idpo`: which prompts a round takes, which rounds are left after a restart, and
how a finished round is recorded."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlhf.runtime.run import Run
from hpc_rlhf.trainers import rounds
from hpc_rlhf.utils.metrics import read_metrics
from tests.recipes import one_rank_world


def a_run(out: Path) -> Run:
    return Run(cfg=None, mode="rs", output_dir=out, rank=0, world_size=1, device=None)


def test_round_prompts_take_the_next_block():
    rows = list(range(5))
    assert rounds.round_prompts(rows, 2, 0) == [0, 1] and rounds.round_prompts(rows, 2, 1) == [2, 3]
    assert rounds.round_prompts(rows, 2, 2) == [4, 0]
    assert rounds.round_prompts(rows, None, 3) == rows


def test_remaining_rounds_start_after_the_finished_ones(tmp_path):
    run = a_run(tmp_path)
    assert list(rounds.remaining_rounds(run, 0, 2)) == [(1, tmp_path / "round_1"), (2, tmp_path / "round_2")]
    assert list(rounds.remaining_rounds(run, 1, 3)) == [(2, tmp_path / "round_2"), (3, tmp_path / "round_3")]
    assert list(rounds.remaining_rounds(run, 2, 2)) == []
    assert rounds.round_dir(run, 0) == tmp_path / "round_0"


def test_finish_round_logs_the_round_and_counts_it(tmp_path):
    one_rank_world()
    run = a_run(tmp_path)
    assert rounds.read_rounds_done(tmp_path) == 0
    logger = rounds.open_round_logger(run)
    rounds.finish_round(run, logger, 1, {"mean_score": 0.5})
    rounds.finish_round(run, logger, 2, {"mean_score": 0.75})
    logger.close()
    assert rounds.read_rounds_done(tmp_path) == 2
    assert json.loads((tmp_path / rounds.ROUNDS_FILE).read_text()) == {"completed": 2}
    assert [(row["step"], row["mean_score"]) for row in read_metrics(tmp_path)] == [(1, 0.5), (2, 0.75)]
    assert not list(tmp_path.glob("*.tmp"))

    run.start_step = rounds.read_rounds_done(tmp_path)  # a restart: the logger continues after round 2
    logger = rounds.open_round_logger(run)
    rounds.finish_round(run, logger, 3, {"mean_score": 1.0})
    logger.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
