"""hpc_rlhf/runtime/best_model.py (checkpoint.best_metric): which figure is better, the record in the run folder read
as untrusted, and a swap that a killed job left half done put right. The whole path runs in tests/trainers/test_sft.py
(one model) and tests/rl/test_step.py (the actor)."""

from __future__ import annotations

import json
import math

from hpc_rlhf.runtime import best_model


def test_lower_is_better_for_a_loss_unless_told_and_a_nan_never_wins():
    assert best_model.lower_is_better("eval_loss", "auto") and not best_model.lower_is_better("eval_accuracy", "auto")
    assert not best_model.lower_is_better("eval_loss", "max") and best_model.lower_is_better("eval_accuracy", "min")
    assert best_model.beats(0.5, None, lower=True) and best_model.beats(0.4, 0.5, lower=True)
    assert not best_model.beats(0.5, 0.5, lower=True) and not best_model.beats(0.6, 0.5, lower=True)
    assert best_model.beats(0.6, 0.5, lower=False) and not best_model.beats(0.5, 0.5, lower=False)
    assert not best_model.beats(math.nan, None, lower=False) and not best_model.beats(math.inf, 0.5, lower=False)


def test_the_record_counts_only_for_its_own_figure_and_a_bad_one_is_no_record(tmp_path, caplog):
    folder = tmp_path / "best"
    folder.mkdir()
    assert best_model.read_record(folder, "eval_loss") is None  # none yet
    record = folder / best_model.RECORD
    record.write_text(json.dumps({"metric": "eval_loss", "value": 1.25, "step": 4}))
    assert best_model.read_record(folder, "eval_loss") == 1.25
    assert best_model.read_record(folder, "eval_accuracy") is None  # the run now asks for another figure
    for bad in ("{not json", json.dumps({"metric": "eval_loss", "value": "high"}), json.dumps([1, 2]),
                json.dumps({"metric": "eval_loss", "value": float("nan")}), "x" * 100_000):
        record.write_text(bad)
        assert best_model.read_record(folder, "eval_loss") is None, bad
    assert "not a record of the best model" in caplog.text


def test_a_swap_cut_short_is_finished_or_undone(tmp_path):
    best, replaced, staging = (tmp_path / name for name in (best_model.BEST_DIR, ".best.replaced", ".best.staging"))
    # killed after best/ was moved aside, before the new one took its place: the old one comes back
    replaced.mkdir()
    (replaced / best_model.RECORD).write_text("{}")
    staging.mkdir()
    (staging / "model.safetensors").write_text("half")
    best_model.recover(tmp_path)
    assert (best / best_model.RECORD).is_file() and not replaced.exists() and not staging.exists()
    # killed after the new one took its place: the old one is gone, the new one stays
    replaced.mkdir()
    (replaced / best_model.RECORD).write_text("{}")
    best_model.recover(tmp_path)
    assert best.is_dir() and not replaced.exists()
