"""How long a packed row fits at which sequence-parallel degree: the memory model's GB per GPU for every trained and
scoring role of the 70B flagship layout (sbatch/ppo_70b.sbatch: 4 nodes x 8 GPUs of 80 GB; actor 8, critic 8,
reference 4, reward 4; ZeRO-3, Adam states offloaded, gradient checkpointing, micro-batch 1) at 8k, 32k and 64k
tokens and K = 1, 2, 4, 8 ranks sharing each row (placement keys actor_sp, critic_sp, ref_sp, reward_sp). The figures
are the planner's (hpc_rlhf.dist.allocation.check_allocation, what `--dry-run` and `hpc-rlhf plan` check, NCCL
buffers included); nothing runs. Prints the table of docs/planner.md ("Long contexts").

    .venv/bin/python benchmarks/long_context.py [--lengths 8192 32768 65536] [--ks 1 2 4 8] [--json]

The reference and reward roles have 4 ranks, so K = 8 gives them blocks of 4 (their K is at most their ranks).
The rollout engine (one of tensor-parallel 8) is left out: its KV cache grows with the samples in flight, not with
K (examples/long_context/ppo_70b_32k.yaml sizes it for 32k).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_rlhf.dist.allocation import Allocation, RoleLoad, check_allocation  # noqa: E402
from hpc_rlhf.dist.memory import ModelShape  # noqa: E402
from hpc_rlhf.scale import communicators  # noqa: E402

ROLES = {"actor": 8, "critic": 8, "ref": 4, "reward": 4}  # sbatch/ppo_70b.sbatch's layout, rollout aside
ROLLOUT = "rollout=8,rollout_tp=8"
GPU_GB = 80.0


def placement(k: int) -> str:
    counts = [f"{name}={count}" for name, count in ROLES.items()]
    blocks = [f"{name}_sp={min(k, count)}" for name, count in ROLES.items() if min(k, count) > 1]
    return ",".join(counts + [ROLLOUT] + blocks)


def figures(length: int, k: int) -> dict:
    """GB per GPU of each role at rows of `length` tokens shared by `k` ranks, and whether all four fit."""
    shape = ModelShape.preset("70b")

    def load_of(name: str, kind: str) -> RoleLoad:
        return RoleLoad(kind=kind, shape=shape, zero_stage=3, adam_offload=kind in ("actor", "critic"),
                        micro_batch_size=1, seq_len=length, gradient_checkpointing=True,
                        tokens_in_flight=32 * length)

    report = check_allocation(placement(k), Allocation(32, 8, GPU_GB), load_of,
                              extra_gb_of=lambda plan: communicators.buffers_gb(plan, 3))
    rows = {name: report["roles"][name] for name in ROLES}
    return {"tokens": length, "k": k, "placement": placement(k),
            "gb_per_rank": {name: row["memory_gb_per_rank"] for name, row in rows.items()},
            "activations_gb": {name: row["breakdown_gb"]["activations"] for name, row in rows.items()},
            "fits": all(row["memory_gb_per_rank"] <= GPU_GB for row in rows.values())}


def table(results: list[dict]) -> str:
    lines = ["| tokens per row | K | actor GB (activations) | critic GB | ref GB | reward GB | fits 80 GB |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in results:
        gb, act = r["gb_per_rank"], r["activations_gb"]
        lines.append(f"| {r['tokens']:,} | {r['k']} | {gb['actor']:.1f} ({act['actor']:.1f}) | {gb['critic']:.1f} | "
                     f"{gb['ref']:.1f} | {gb['reward']:.1f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536], help="tokens per packed row")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8], help="ranks sharing a row")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object after the table")
    args = parser.parse_args(argv)
    results = [figures(length, k) for length in args.lengths for k in args.ks]
    print(table(results))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
