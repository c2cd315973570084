"""All-reduce bandwidth across the job's ranks: the first thing to check on a new cluster (is NCCL on InfiniBand, or
on a TCP socket at a fraction of the speed?), and the first step of sbatch/smoke_gpu.sbatch.

    hpc-rlhf bandwidth [--size-mb 256] [--iters 20] [--warmup 5]     # on every rank (srun, torchrun, ...)

Each rank joins the world (hpc_rlhf.dist.bootstrap: NCCL on GPUs, gloo on CPUs), all-reduces a float32 tensor of
`--size-mb` MB `--warmup` times untimed and `--iters` times timed, and rank 0 prints the time of one all-reduce
and two figures as nccl-tests defines them: algorithm bandwidth (bytes / time) and bus bandwidth (algorithm
bandwidth x 2 (n - 1) / n, what each link carries in a ring: comparable with the fabric's rated speed whatever the
number of ranks).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Bandwidth:
    ranks: int
    size_bytes: int
    seconds: float  # one all-reduce, the median of the timed ones

    @property
    def algbw_gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.ranks)

    def line(self, backend: str) -> str:
        return (f"all-reduce of {self.size_bytes / 1e6:,.0f} MB over {self.ranks} ranks ({backend}): "
                f"{self.seconds * 1e3:,.2f} ms, algorithm bandwidth {self.algbw_gbps:,.2f} GB/s, bus bandwidth "
                f"{self.busbw_gbps:,.2f} GB/s")


def bus_factor(ranks: int) -> float:
    """What each link of a ring carries per byte all-reduced: 2 (n - 1) / n (0 for one rank: no link)."""
    return 2.0 * (ranks - 1) / ranks


def measure_allreduce(size_mb: float, iters: int, warmup: int, group=None) -> Bandwidth:
    """Time `iters` all-reduces of `size_mb` MB on the current device, after `warmup` untimed ones; every rank of
    `group` (default: the world) must call it."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    tensor = torch.ones(max(1, int(size_mb * 1e6) // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device != "cpu":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if device != "cpu":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return Bandwidth(dist.get_world_size(group), tensor.numel() * 4, sorted(times)[len(times) // 2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rlhf bandwidth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=256.0, help="MB all-reduced each time")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces (the median is printed)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces first (rings and buffers)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--timeout-s", type=float, default=300, help="rendezvous and collective timeout")
    args = parser.parse_args(argv)
    if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0:
        parser.error("--size-mb must be positive, --iters at least 1, --warmup at least 0")
    import torch.distributed as dist

    from hpc_rlhf.dist import bootstrap  # torch: `hpc-rlhf --help` lists this command without importing it

    info = bootstrap.init_distributed(args.backend, timeout_s=args.timeout_s)
    try:
        result = measure_allreduce(args.size_mb, args.iters, args.warmup)
        if info.rank == 0:
            print(result.line(dist.get_backend()), flush=True)
    finally:
        bootstrap.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
