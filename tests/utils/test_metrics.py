import json

import pytest

from hpc_rlhf.utils.metrics import MetricsError, MetricsLogger, is_wall_clock, read_metrics


def test_metrics_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, progress=False)
    logger.log(1, {"loss": 2.5, "accuracy": 0.5})
    logger.log(2, {"loss": float("nan")})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == 2.5
    assert rows[1]["loss"] == "nan"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    for step in range(1, 6):
        logger.log(step, {"loss": float(step)})
    logger.close()
    resumed = MetricsLogger(tmp_path, tensorboard=False, progress=False, initial_step=3)
    resumed.log(4, {"loss": 40.0})
    resumed.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == 40.0


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "x", enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "x").exists()


def test_a_torn_last_line_is_dropped_and_the_resume_goes_on(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    for step in range(1, 4):
        logger.log(step, {"loss": float(step)})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "loss"')  # the node died in the middle of the write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "its last line (4) is not a whole JSON row" in caplog.text
    resumed = MetricsLogger(tmp_path, tensorboard=False, progress=False, initial_step=3)
    resumed.log(4, {"loss": 4.0})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_bad_line_inside_the_file_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=r"metrics\.jsonl, line 2: not a JSON row"):
        read_metrics(tmp_path)


def test_a_run_that_starts_over_keeps_the_earlier_runs_metrics(tmp_path):
    for run in range(3):
        logger = MetricsLogger(tmp_path, tensorboard=False, progress=False)  # step 0: no checkpoint to resume
        logger.log(1, {"loss": float(run)})
        logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0)]
    kept = [json.loads((tmp_path / f"metrics.jsonl.{n}").read_text())["loss"] for n in (1, 2)]
    assert kept == [0.0, 1.0]


def test_wall_clock_figures_are_told_from_the_ones_a_seeded_run_repeats():
    assert all(map(is_wall_clock, ["time", "time_step", "time_generate", "samples_per_s", "tokens_per_s",
                                   "env_time_share", "wall_s", "elapsed_s"]))
    assert not any(map(is_wall_clock, ["step", "reward", "policy_loss", "kl_k1", "response_length", "pad_share",
                                       "env_s", "tokens_per_step", "timeout_episodes"]))
