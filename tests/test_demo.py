"""hpc_rlhf/demo.py (`hpc-rlhf demo`): the stages it chains, with the runs themselves stood in for (the whole demo
takes minutes: `make demo`, figures in docs/results.md). The control's length is a step count, not a time, so a
seeded demo prints the same figures however busy the machine is."""

from __future__ import annotations

import pytest

from hpc_rlhf import demo


@pytest.fixture
def stages(monkeypatch, tmp_path):
    """Each stage's (mode, overrides) as the demo asks for it, the stages taking `seconds[mode]`."""
    asked, seconds = [], {}

    def stage(name, mode, overrides):
        asked.append((mode, overrides))
        return seconds.get(mode, 1.0)

    monkeypatch.setattr(demo, "stage", stage)
    monkeypatch.setattr(demo, "ensure_assets", lambda: None)
    monkeypatch.setattr(demo, "read_metrics", lambda _: [{"step": 10, "time": 5.0, "lr": 3e-4, "eval_accuracy": 0.5}])
    monkeypatch.setattr(demo, "draw", lambda *args, **kwargs: tmp_path / "plot.png")
    return asked, seconds


def control_overrides(asked):
    (mode, overrides), = [a for a in asked if any("sft_control" in o for o in a[1])]
    return mode, [o for o in overrides if o.startswith(("train.max_steps=", "train.lr="))]


def test_the_control_trains_a_fixed_number_of_steps_however_long_ppo_took(stages, tmp_path):
    asked, seconds = stages
    assert demo.main(["--out", str(tmp_path)]) == 0
    first = control_overrides(asked)
    assert first == ("sft", [f"train.max_steps={demo.CONTROL_STEPS}", "train.lr=0.0003"])
    asked.clear()
    seconds["ppo"] = 500.0  # a machine ten times busier while PPO ran
    assert demo.main(["--out", str(tmp_path)]) == 0
    assert control_overrides(asked) == first
    asked.clear()
    assert demo.main(["--out", str(tmp_path), "--control-steps", "7", "--quick"]) == 0
    assert control_overrides(asked)[1][-2:] == ["train.max_steps=7", "train.lr=0.0003"]


def test_a_control_of_no_steps_is_refused_before_any_stage(stages, tmp_path, capsys):
    asked, _ = stages
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--out", str(tmp_path), "--control-steps", "0"])
    assert exit_info.value.code == 2 and asked == []
    assert "--control-steps must be at least 1, got 0" in capsys.readouterr().err
