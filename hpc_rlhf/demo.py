"""`hpc-rlhf demo`: the built-in pipeline on CPU, end to end, on local ranks.

    1. SFT on the tiny addition task, whose demonstrations carry a systematic mistake (DESIGN §7)
    2. a reward model on correct-vs-wrong preference pairs, started from the SFT model
    3. PPO with every role on its own rank (actor, critic, ref, reward, 2 rollout engines: 6 ranks)
    4. the control: the SFT model trained on, on the same demonstrations at the SFT run's final learning rate,
       for CONTROL_STEPS more steps, about as long as the PPO stage takes on an idle 2-core machine (a fixed count,
       not the time measured, so that a seeded demo prints the same figures on a busy machine)

Each stage is the ordinary `hpc-rlhf MODE --config examples/tiny/MODE.yaml` command, run as a subprocess, so
the demo is also a worked example of chaining the modes. At the end it prints held-out exact-match accuracy of
the SFT model, of the PPO actor and of the control, so what RL adds over more imitation shows beside what it
adds over the starting point, and writes `ppo/plot.png` (reward, KL, accuracy per step, the control's accuracy as
a line: `hpc-rlhf plot`) next to the TensorBoard logs. `--seed N` runs every stage at train.seed N.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from hpc_rlhf.data.assets import ensure_assets
from hpc_rlhf.plot import draw
from hpc_rlhf.utils.metrics import read_metrics

EXAMPLES = Path("examples/tiny")
# SFT steps of the control. On the Intel Xeon 2-core VM, PPO's 150 steps took 38-65 s and the SFT stage's pace
# gave 279-532 steps in that time, as busy as the machine was (docs/results.md, "The demo").
CONTROL_STEPS = 300
QUICK_STEPS = 20


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rlhf demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="folder for the three runs")
    parser.add_argument("--quick", action="store_true", help="far fewer steps (a smoke run, not a result)")
    parser.add_argument("--seed", type=int, default=0, help="train.seed of every stage")
    parser.add_argument("--control-steps", type=int, default=None,
                        help=f"SFT steps of the control (default {CONTROL_STEPS}; {QUICK_STEPS} with --quick)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    control_steps = args.control_steps if args.control_steps is not None else (
        QUICK_STEPS if args.quick else CONTROL_STEPS)
    if control_steps < 1:
        parser.error(f"--control-steps must be at least 1, got {control_steps}")
    quick = [f"train.max_steps={QUICK_STEPS}", "log.eval_every_steps=10"] if args.quick else []
    quick += [f"train.seed={args.seed}"]
    ensure_assets()
    times = {}
    times["sft"] = stage("1/4 supervised fine-tuning", "sft", [f"output_dir={out}/sft", *quick])
    times["rm"] = stage("2/4 reward model", "rm", [f"output_dir={out}/rm", f"model.path={out}/sft/final", *quick])
    times["ppo"] = stage("3/4 PPO (actor, critic, ref, reward, 2 rollout engines on 6 ranks)", "ppo",
                         [f"output_dir={out}/ppo", f"actor.path={out}/sft/final", f"critic.path={out}/rm/final",
                          f"reward.models=[{out}/rm/final]", *quick])
    sft_rows = read_metrics(out / "sft")
    sft_lr = last(sft_rows, "lr")
    times["control"] = stage(f"4/4 control: SFT trained on for {control_steps} more steps", "sft",
                             [f"output_dir={out}/sft_control", f"model.path={out}/sft/final", *quick,
                              f"train.max_steps={control_steps}", f"train.lr={sft_lr}", "train.warmup_steps=0",
                              "train.min_lr_ratio=1.0", f"log.eval_every_steps={control_steps}",
                              "checkpoint.resume=false"])
    rm_rows, ppo_rows, control_rows = (read_metrics(out / m) for m in ("rm", "ppo", "sft_control"))
    plot = draw(out / "ppo", out / "ppo" / "plot.png", out / "sft_control",
                control_label=f"control: SFT trained on for {control_steps} more steps")
    before, after = first(ppo_rows, "eval_accuracy"), last(ppo_rows, "eval_accuracy")
    print("\n=== results (held-out 2-digit additions, greedy, exact match)")
    print(f"SFT model                      : {last(sft_rows, 'eval_accuracy')}")
    print(f"reward model pairwise accuracy : {last(rm_rows, 'eval_accuracy')}")
    print(f"PPO actor, before RL           : {before}")
    print(f"PPO actor, after RL            : {after}")
    print(f"control, SFT trained on        : {last(control_rows, 'eval_accuracy')} ({control_steps} more SFT steps at "
          f"lr {sft_lr:.2g}, {times['control']:.0f} s against PPO's {times['ppo']:.0f} s)")
    print("stage times (s)                : " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"plot                           : {plot} (hpc-rlhf plot {out / 'ppo'} --control {out / 'sft_control'})")
    print(f"TensorBoard                    : tensorboard --logdir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
