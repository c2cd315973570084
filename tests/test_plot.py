"""`hpc-rlhf plot`: an RL run's figures from its metrics.jsonl, with a control run's accuracy as a line (the lines of
the figure are checked, not its pixels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rlhf.cli import main
from hpc_rlhf.plot import figure


def _run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def _rl_rows(episodes: bool = False) -> list[dict]:
    rows = [{"step": 0, "time": 1.0, "eval_accuracy": 0.5}]
    for step in range(1, 5):
        row = {"step": step, "time": 1.0 + step, "reward": 0.1 * step, "kl_k1": 0.01 * step, "kl_k3": 0.02 * step}
        if episodes:
            row.update(turns_mean=2.0 + step, tool_calls_mean=1.0)
        rows.append(row)
    rows[2]["reward"] = "nan"  # a non-finite figure is logged as text: left out
    rows.append({"step": 4, "time": 6.0, "eval_accuracy": 0.75})
    return rows


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_the_png_is_written_with_the_controls_accuracy_as_a_line(tmp_path, capsys):
    run = _run(tmp_path / "ppo", _rl_rows())
    control = _run(tmp_path / "sft_control", [{"step": 0, "eval_accuracy": 0.55}, {"step": 9, "loss": 1.0},
                                              {"step": 9, "eval_accuracy": 0.6}])
    out = tmp_path / "figures" / "ppo.png"
    assert main(["plot", str(run), "--out", str(out), "--control", str(control)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(run)]) == 0  # default: RUN_DIR/plot.png
    assert (run / "plot.png").is_file()


def test_the_figure_has_reward_kl_and_accuracy_with_the_control_line():
    fig = figure(_rl_rows(), control=0.6, control_label="control (sft_control)")
    reward, kl, accuracy = fig.axes
    assert _lines(reward) == {"reward": ([1, 3, 4], [0.1, 0.30000000000000004, 0.4])}
    assert set(_lines(kl)) == {"kl_k1", "kl_k3"}
    lines = _lines(accuracy)
    assert lines["eval_accuracy"] == ([0, 4], [0.5, 0.75])
    assert lines["control (sft_control): 0.6"][1] == [0.6, 0.6]  # a horizontal line at the control's accuracy
    assert accuracy.get_legend() is not None


def test_a_run_with_episodes_gets_their_panel_and_no_control_no_line():
    fig = figure(_rl_rows(episodes=True))
    assert len(fig.axes) == 4
    assert set(_lines(fig.axes[3])) == {"turns_mean", "tool_calls_mean"}
    assert list(_lines(fig.axes[2])) == ["eval_accuracy"]


@pytest.mark.parametrize("what, expected", [
    ("no folder", "{d}/missing has no metrics.jsonl"),
    ("not an RL run", "no step logged a reward: `hpc-rlhf plot` draws RL runs"),
    ("control without accuracy", "{d}/control/metrics.jsonl has no eval_accuracy"),
    ("not JSON", "{d}/broken/metrics.jsonl, line 2: not JSON"),
])
def test_what_cannot_be_drawn_is_refused_in_one_line(tmp_path, capsys, what, expected):
    run = _run(tmp_path / "ppo", _rl_rows())
    sft = _run(tmp_path / "sft", [{"step": 1, "loss": 2.0}, {"step": 1, "eval_accuracy": 0.5}])
    _run(tmp_path / "control", [{"step": 1, "loss": 2.0}])
    (_run(tmp_path / "broken", [{"step": 1}]) / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n')
    argv = {"no folder": [str(tmp_path / "missing")], "not an RL run": [str(sft)],
            "control without accuracy": [str(run), "--control", str(tmp_path / "control")],
            "not JSON": [str(tmp_path / "broken")]}[what]
    assert main(["plot", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpc-rlhf plot: ") and expected.format(d=tmp_path) in err and err.count("\n") == 1, err
