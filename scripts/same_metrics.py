"""Compare the metrics.jsonl of two folders made by scripts/same_metrics.sh, wall-clock fields aside.

    python scripts/same_metrics.py OUT_A OUT_B

Exit 0 when every run's rows are equal bit for bit (floats compared as JSON wrote them), 1 otherwise, with the
first differing row of each run that differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hpc_rlhf.utils.metrics import is_wall_clock


def rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not is_wall_clock(k)}
            for line in path.read_text().splitlines() if line.strip()]


def main(a: str, b: str) -> int:
    found = sorted(p.relative_to(a) for p in Path(a).rglob("metrics.jsonl"))
    if not found:
        print(f"no metrics.jsonl under {a}")
        return 1
    bad = 0
    for rel in found:
        left, right = rows(Path(a) / rel), rows(Path(b) / rel) if (Path(b) / rel).is_file() else None
        if left == right:
            print(f"same  {rel} ({len(left)} rows)")
            continue
        bad += 1
        if right is None:
            print(f"DIFF  {rel}: missing under {b}")
            continue
        first = next((i for i, (x, y) in enumerate(zip(left, right)) if x != y), min(len(left), len(right)))
        print(f"DIFF  {rel}: {len(left)} rows against {len(right)}; first difference at row {first}")
        if first < min(len(left), len(right)):
            x, y = left[first], right[first]
            print("   ", {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
