"""Run a script on N local ranks (gloo, one thread per rank) and check that it succeeded.

A distributed test keeps its worker code in the test module itself and calls `run_ranks(N, __file__, "case-name",
*args)`; the module ends with `if __name__ == "__main__": run_worker({"case-name": worker, ...})`, which runs
`worker(*args)` on every rank of a gloo world.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable

from hpc_rlhf.utils.cpu_kernels import pin_cpu_kernels

REPO = Path(__file__).resolve().parents[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    env.update(extra or {})
    pin_cpu_kernels(env)  # worker scripts may import torch before hpc_rlhf
    return env


def run_ranks(nproc: int, script: str | Path, *args: str, timeout: float = 180,
              env: dict[str, str] | None = None, check: bool = True,
              launcher: str = "fork") -> subprocess.CompletedProcess:
    """`launcher="fork"`: the ranks are forks of one interpreter that imported the heavy libraries once
    (tests/fork_ranks.py); `"torchrun"`: torchrun's fresh interpreters, for the tests about torchrun itself."""
    if launcher == "fork":
        cmd = [sys.executable, str(REPO / "tests" / "fork_ranks.py"), str(nproc), str(script), *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--max_restarts=0", "--monitor_interval=0.5", str(script), *args]
    else:
        raise ValueError(f"run_ranks: launcher must be 'fork' or 'torchrun', not {launcher!r}")
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{nproc}-rank run of {Path(script).name} {' '.join(args)} failed "
                             f"(exit {proc.returncode}):\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-10000:]}")
    return proc


def run_worker(cases: dict[str, Callable[..., object]], timeout_s: float | None = None) -> None:
    """A worker script's `__main__` on each rank: join a gloo world (one thread per rank; `timeout_s` bounds its
    collectives, torch's default when None), run the case named by sys.argv[1] with the arguments after it (as
    strings), and leave the world together once every rank has finished the case."""
    import torch
    import torch.distributed as dist

    # Checked before joining, so that a misnamed case costs no rendezvous and fails with one line, not a traceback.
    script = Path(sys.argv[0]).name
    if len(sys.argv) < 2:
        raise SystemExit(f"{script}: no worker case given; its cases: {', '.join(cases)}")
    case, args = sys.argv[1], sys.argv[2:]
    if case not in cases:
        raise SystemExit(f"{script}: no worker case {case!r}; its cases: {', '.join(cases)}")
    torch.set_num_threads(1)
    if timeout_s is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    cases[case](*args)
    dist.barrier()
    dist.destroy_process_group()


def _raise_priority(by: int):
    """A pre-exec hook that lowers the child's niceness by `by`, where this user may (root), and does nothing
    where it may not: a priority only changes who waits for whom, never a result."""
    def hook() -> None:
        try:
            os.nice(-by)
        except OSError:
            pass
    return hook


def hpc_rlhf_cli(*args: str, timeout: float = 900, check: bool = True, threads: int = 1,
                 env: dict[str, str] | None = None, priority: int = 0) -> subprocess.CompletedProcess:
    """`python -m hpc_rlhf ARGS` as a user types it (the local launcher starts the ranks the placement needs).
    `priority` > 0 lowers the job's niceness by that much where allowed (tests/recipes.py says why)."""
    # The thread count fixes the order of float sums, and the learning tests were measured with theirs (the PPO
    # test's reward model: 0.97 held-out accuracy on 2 threads, 0.80 on 1). Threads spin while they wait
    # (OpenMP's default): on a quiet machine that was measured 1.6x faster than OMP_WAIT_POLICY=PASSIVE (200 SFT
    # base steps: 38 s against 60 s), though beside another busy process it is the slower one by far.
    full_env = worker_env({"OMP_NUM_THREADS": str(threads), **(env or {})})
    proc = subprocess.run([sys.executable, "-m", "hpc_rlhf", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_raise_priority(priority) if priority else None)
    if check and proc.returncode != 0:
        raise AssertionError(f"hpc-rlhf {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc
