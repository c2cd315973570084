from hpc_rlhf.utils.metrics import MetricsLogger, read_metrics


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
