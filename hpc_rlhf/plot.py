"""`hpc-rlhf plot RUN_DIR [--out FILE.png] [--control RUN_DIR]`: the figures of an RL run (ppo, grpo), drawn from
its metrics.jsonl into a PNG (default RUN_DIR/plot.png).

Panels: the reward (mean score of a step's samples), the KL of the actor to the reference (per sequence: k1, and
the configured estimator when it is another), the held-out exact match, and, for a run that played episodes
(env.name, env.http_url), turns and tool calls per episode. With `--control`, the last held-out exact match of
that run (an SFT run trained on from the RL run's starting model, as `hpc-rlhf demo` makes) is a reference line on
the accuracy panel: what RL adds over more imitation shows at a glance. The figure is drawn with matplotlib's
Agg backend (no display needed, as on a compute node).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from hpc_rlhf.utils.metrics import METRICS_FILE

PROG = "hpc-rlhf plot"
KL_KEY = re.compile(r"kl_k\d$")
EPISODE_KEYS = ("turns_mean", "tool_calls_mean")


class PlotError(ValueError):
    """A run folder that cannot be drawn; the message names the folder or file and why."""


def read_rows(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl; a missing file or a line that is not JSON is a PlotError naming it."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{run_dir} has no {METRICS_FILE} (is it a run's output_dir?)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlotError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `key` as a number (a non-finite value is logged as text: left out)."""
    points = [(row.get("step", 0), row[key]) for row in rows
              if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)]
    return [p[0] for p in points], [float(p[1]) for p in points]


def last_accuracy(run_dir: str | Path) -> float:
    """The last held-out exact match (`eval_accuracy`) a run logged."""
    _, values = series(read_rows(run_dir), "eval_accuracy")
    if not values:
        raise PlotError(f"{run_dir}/{METRICS_FILE} has no eval_accuracy (the control needs a held-out evaluation: "
                        f"log.eval_every_steps > 0 and eval.prompt_files)")
    return values[-1]


def figure(rows: list[dict], control: float | None = None, control_label: str = "control", title: str = ""):
    """The matplotlib Figure of an RL run's rows, with the control's accuracy as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series(rows, "reward")[0]:
        raise PlotError("no step logged a reward: `hpc-rlhf plot` draws RL runs (ppo, grpo)")
    kl_keys = sorted({key for row in rows for key in row if KL_KEY.match(key)})
    episodes = [key for key in EPISODE_KEYS if series(rows, key)[0]]
    panels = [("reward (mean score)", ["reward"]), ("KL to the reference (per sequence)", kl_keys),
              ("held-out exact match", ["eval_accuracy"])]
    if episodes:
        panels.append(("per episode", episodes))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, (panel_title, keys) in zip(axes[0], panels):
        for key in keys:
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, label=key, marker="o" if key == "eval_accuracy" else None, markersize=3)
        if not keys:
            ax.text(0.5, 0.5, "no KL logged (no reference)", ha="center", va="center", transform=ax.transAxes)
        if keys == ["eval_accuracy"] and control is not None:
            ax.axhline(control, color="tab:gray", linestyle="--", label=f"{control_label}: {control:.3g}")
        if len(ax.get_lines()) > 1:  # the control's line counts
            ax.legend(fontsize=8)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw(run_dir: str | Path, out: str | Path | None = None, control_dir: str | Path | None = None,
         control_label: str | None = None) -> Path:
    """Write the PNG of `run_dir` (default RUN_DIR/plot.png), with `control_dir`'s last accuracy as the control
    line; return its path."""
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    control = last_accuracy(control_dir) if control_dir is not None else None
    label = control_label or (f"control ({Path(control_dir).name})" if control_dir is not None else "control")
    fig = figure(rows, control, label, title=str(run_dir))
    path = Path(out) if out is not None else Path(run_dir) / "plot.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="an RL run's output_dir (it holds metrics.jsonl)")
    parser.add_argument("--out", default=None, metavar="FILE.png", help="where to write (default RUN_DIR/plot.png)")
    parser.add_argument("--control", default=None, metavar="RUN_DIR",
                        help="an SFT run trained on from the same start: its last eval_accuracy is drawn as a line")
    args = parser.parse_args(argv)
    try:
        path = draw(args.run_dir, args.out, args.control)
    except (PlotError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
