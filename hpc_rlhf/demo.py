"""`hpc-rlhf demo`: the built-in pipeline on CPU, end to end, on local ranks.

    1. SFT on the tiny addition task, whose demonstrations carry a systematic mistake (DESIGN §7)
    2. a reward model on correct-vs-wrong preference pairs, started from the SFT model
    3. PPO with every role on its own rank (actor, critic, ref, reward, 2 rollout engines: 6 ranks)

Each stage is the ordinary `hpc-rlhf MODE --config examples/tiny/MODE.yaml` command, run as a subprocess, so
the demo is also a worked example of chaining the modes. At the end it prints held-out exact-match accuracy of
the SFT model and of the PPO actor, and writes `ppo/plot.png` (reward, KL, accuracy per step) next to the
TensorBoard logs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from hpc_rlhf.data.assets import ensure_assets
from hpc_rlhf.utils.metrics import read_metrics

EXAMPLES = Path("examples/tiny")


def stage(name: str, mode: str, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", "hpc_rlhf", mode, "--config", str(EXAMPLES / f"{mode}.yaml"), *overrides]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    code = subprocess.call(cmd, env=env)
    if code != 0:
        raise SystemExit(f"demo: stage '{name}' failed with exit code {code}")
    return time.perf_counter() - start


def last(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def first(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[0] if values else None


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("reward", "kl_k1", "eval_accuracy"),
                              ("reward (mean score)", "KL to reference (k1, per sequence)", "held-out exact match")):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "eval_accuracy" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rlhf demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder for the three runs")
    parser.add_argument("--quick", action="store_true", help="far fewer steps (a smoke run, not a result)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    quick = ["train.max_steps=20", "log.eval_every_steps=10"] if args.quick else []
    ensure_assets()
    times = {}
    times["sft"] = stage("1/3 supervised fine-tuning", "sft", [f"output_dir={out}/sft", *quick])
    times["rm"] = stage("2/3 reward model", "rm", [f"output_dir={out}/rm", f"model.path={out}/sft/final", *quick])
    times["ppo"] = stage("3/3 PPO (actor, critic, ref, reward, 2 rollout engines on 6 ranks)", "ppo",
                         [f"output_dir={out}/ppo", f"actor.path={out}/sft/final", f"critic.path={out}/rm/final",
                          f"reward.models=[{out}/rm/final]", *quick])
    sft_rows, rm_rows, ppo_rows = (read_metrics(out / m) for m in ("sft", "rm", "ppo"))
    plot(ppo_rows, out / "ppo" / "plot.png")
    before, after = first(ppo_rows, "eval_accuracy"), last(ppo_rows, "eval_accuracy")
    print("\n=== results (held-out 2-digit additions, greedy, exact match)")
    print(f"SFT model                      : {last(sft_rows, 'eval_accuracy')}")
    print(f"reward model pairwise accuracy : {last(rm_rows, 'eval_accuracy')}")
    print(f"PPO actor, before RL           : {before}")
    print(f"PPO actor, after RL            : {after}")
    print("stage times (s)                : " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"plot                           : {out / 'ppo' / 'plot.png'}")
    print(f"TensorBoard                    : tensorboard --logdir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
