"""Start N local ranks of a test's worker script as forks of one interpreter (`run_ranks`' default).

    python tests/fork_ranks.py NPROC SCRIPT [ARGS...]

torchrun starts every rank as a fresh interpreter, and each one imports torch, transformers and deepspeed again:
about 4 CPU-seconds per rank, more than most distributed tests spend on their own work when their ranks share two
cores. This interpreter imports them once and forks the ranks through the project's own local launcher
(`hpc_rlhf.launch.local.spawn_local`: torchrun's variables, one line naming the first failed rank, the others
stopped after a grace period), each rank running SCRIPT as `__main__` with ARGS, as `python SCRIPT ARGS` would.
The tests that are about torchrun itself keep it (`run_ranks(..., launcher="torchrun")`; its workers start
through the zygote's stand-in, tests/distributed.py `torchrun`).
"""

from __future__ import annotations

import io
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    nproc, script, args = int(argv[0]), str(Path(argv[1]).resolve()), argv[2:]
    import hpc_rlhf  # noqa: F401  (pins the CPU kernels before torch loads, as in every rank)
    import torch

    from hpc_rlhf.launch.local import import_what_ranks_use, spawn_local

    torch.set_num_threads(1)
    import_what_ranks_use()  # what the local launcher imports before it forks the ranks of a mode

    def rank_main() -> int:
        # Whole lines per write(2): the ranks share the launcher's pipes, and print() under PYTHONUNBUFFERED
        # writes the text and its newline apart, so two ranks' lines could interleave ("OK rank 0OK rank 1\n\n").
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
                                                   line_buffering=True) for fd in (1, 2))
        sys.argv = [script, *args]
        sys.path[0] = str(Path(script).parent)  # as for `python SCRIPT`
        runpy.run_path(script, run_name="__main__")
        return 0

    return spawn_local(nproc, [sys.executable, script, *args], target=rank_main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
