"""Lines written where several processes share one pipe.

The ranks of a job write to their launcher's pipes (torchrun, srun, the local launcher), and print() under
PYTHONUNBUFFERED writes a text and its newline apart: two ranks' lines then run together ("... seen by rank
1]hpc_rlhf: rank 0 ..."). A line that a reader or a test looks for goes out whole, in one write(2).
"""

from __future__ import annotations

import os
import sys


def say(line: str, fd: int = 2) -> None:
    """Write `line` and its newline in one write(2) to `fd` (2: stderr), after what Python buffered before it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or detached: nothing of ours is waiting in it
            pass
    os.write(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
