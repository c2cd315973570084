"""Run the learning tests (pytest marker `learning`) over several seeds, and once with learning switched off, and
print what each one measured: the figures behind every threshold, seed by seed, with their range.

    python scripts/calibrate_learning_tests.py --seeds 0 1 2 3 4 --control --out runs/calibration
    python scripts/calibrate_learning_tests.py --report runs/calibration     # the table again, nothing run

Each seed is one pytest session with HPC_RLHF_TEST_SEED=N (tests/recipes.py): the shared models (SFT
base, the reward model the PPO tests start from) and every tested run are trained at that seed, as a fresh CI session
would at seed 0. The control session (HPC_RLHF_TEST_NO_LEARNING=1, seed 0) trains each tested stage at lr 0:
every learning test must fail there, or its threshold does not tell a run that learned from one that did not.
A threshold is sound when it holds for every seed with a clear margin and fails the control.

Seeds run one after the other (a session takes ~10 minutes on 2 cores); run two copies of this script with other
seeds and output folders to use both cores. Results are bit-reproducible whatever the load (utils/cpu_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_session(out: Path, seed: int, control: bool, pytest_args: list[str], base_pattern: str | None) -> None:
    name = "control" if control else f"seed{seed}"
    env = dict(os.environ, HPC_RLHF_TEST_SEED=str(seed), HPC_RLHF_TEST_FIGURES=str(out / "figures.jsonl"),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("HPC_RLHF_TEST_SFT_BASE", None)  # each session trains its own base at its seed, unless given one
    if base_pattern:
        env["HPC_RLHF_TEST_SFT_BASE"] = base_pattern.format(seed=seed)
    if control:
        env["HPC_RLHF_TEST_NO_LEARNING"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "learning", "-p", "no:cacheprovider",
           f"--basetemp={out / ('tmp_' + name)}", f"--junitxml={out / (name + '.xml')}", *pytest_args, "tests"]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"{name}: pytest exit {code} after {time.perf_counter() - start:.0f} s (log {out / (name + '.log')})",
          flush=True)


def outcomes(xml_path: Path) -> dict[str, str]:
    """test name -> passed / failed / error / skipped, from a junit file."""
    result = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
        result[case.get("name")] = status
    return result


def report(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()] \
        if (out / "figures.jsonl").is_file() else []
    by_test: dict[str, dict[str, dict[str, object]]] = {}
    for row in rows:
        run = "control" if row["no_learning"] else f"seed {row['seed']}"
        figures = {k: v for k, v in row.items() if k not in ("test", "seed", "no_learning")}
        by_test.setdefault(row["test"], {})[run] = figures
    for test, runs in sorted(by_test.items()):
        print(f"\n## {test}")
        keys = list(dict.fromkeys(k for figures in runs.values() for k in figures))
        names = sorted(runs, key=lambda r: (r == "control", r))
        print("| figure | " + " | ".join(names) + " | min-max over seeds |")
        print("|---" * (len(names) + 2) + "|")
        for key in keys:
            cells, numbers = [], []
            for name in names:
                value = runs[name].get(key)
                cells.append(_fmt(value))
                if name != "control" and isinstance(value, (int, float)):
                    numbers.append(value)
            span = f"{_fmt(min(numbers))} - {_fmt(max(numbers))}" if numbers else ""
            print(f"| {key} | " + " | ".join(cells) + f" | {span} |")
    print("\n## outcomes")
    for xml_path in sorted(out.glob("*.xml")):
        results = outcomes(xml_path)
        counts = {s: sum(v == s for v in results.values()) for s in ("passed", "failed", "error", "skipped")}
        print(f"{xml_path.stem}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
        for test, status in sorted(results.items()):
            expected = "failed" if xml_path.stem == "control" else "passed"
            if status != expected:
                print(f"  {test}: {status} (expected {expected})")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[])
    parser.add_argument("--control", action="store_true", help="also the lr-0 session (seed 0)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "calibration")
    parser.add_argument("--report", type=Path, help="print the table of an earlier run and stop")
    parser.add_argument("--base-pattern", help="reuse SFT bases trained earlier with tests/recipes.py's "
                                               "SFT_BASE at each seed, e.g. runs/bases/seed{seed}/final")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k grpo)")
    args = parser.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        run_session(args.out, seed, False, args.pytest_args, args.base_pattern)
    if args.control:
        run_session(args.out, 0, True, args.pytest_args, args.base_pattern)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
