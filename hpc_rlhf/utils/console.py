"""Lines written where several processes share one pipe, and where progress bars draw.

The ranks of a job write to their launcher's pipes (torchrun, srun, the local launcher), and print() under
PYTHONUNBUFFERED writes a text and its newline apart: two ranks' lines then run together ("... seen by rank
1]hpc_rlhf: rank 0 ..."). A line that a reader or a test looks for goes out whole, in one write(2).

A progress bar (tqdm: the run's own on the logging rank, transformers' while a model loads) redraws its line
after a carriage return and ends it only when it closes. A line written while one is open lands inside the
bar's line (in a Slurm output file: `grpo:   0%|...|rank 0: reward function ... returned nan`), and the bar,
redrawn later, follows it. So before an error or failure line every open bar of the process is closed first
(`close_progress_bars`): it keeps its last state on a line of its own, and the line written next starts a line.

torch's C++ warnings come with stack dumps: when the rendezvous store's process is gone, the store client of
every surviving rank logs a c10d warning ("sendBytes failed ...") followed by some 25 lines of C++ frames
(`frame #0: c10::Error::Error(...)`), before the watchdog's one line says what happened. c10 prints its
warnings at or above the level in TORCH_CPP_LOG_LEVEL, read once, when torch loads (there is no call to change
it later; TORCH_SHOW_CPP_STACKTRACES only concerns exceptions raised into Python). So the package sets it to
ERROR when it is imported, before torch is (`quiet_torch_warnings`): torch's C++ warnings, the stack dumps
among them, are not printed; its errors still are. HPC_RLHF_DEBUG=1 leaves torch's default (warnings shown),
and a TORCH_CPP_LOG_LEVEL the user set is kept.
"""

from __future__ import annotations

import os
import sys


DEBUG_ENV = "HPC_RLHF_DEBUG"
TORCH_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"


def debugging(environ=os.environ) -> bool:
    """HPC_RLHF_DEBUG is 1 (or true, yes, on): show what is kept quiet otherwise."""
    return environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_torch_warnings(environ=os.environ) -> None:
    """TORCH_CPP_LOG_LEVEL=ERROR unless debugging or set already (see the module docstring). Takes effect only
    in a process that has not loaded torch yet, and in the processes it starts."""
    if not debugging(environ):
        environ.setdefault(TORCH_LOG_LEVEL_ENV, "ERROR")


def close_progress_bars() -> None:
    """Close every open tqdm bar of this process, each leaving its last state and a newline.

    For a process about to report a failure and end: a closed bar stays closed (later updates draw nothing).
    Only bars in this process: a rank killed outright leaves its own bar's line open, which no other process can
    end."""
    std = sys.modules.get("tqdm.std")  # never imported here: a process that drew no bar has none to close
    if std is None:
        return
    for bar in list(getattr(std.tqdm, "_instances", ())):
        try:
            bar.leave = True  # not cleared with "\r" and blanks, which a file keeps before the next line
            bar.close()
        except Exception:  # noqa: BLE001 - a bar whose stream is gone has nothing left to end
            pass


def say(line: str, fd: int = 2) -> None:
    """Write `line` and its newline in one write(2) to `fd` (2: stderr), after what Python buffered before it
    and after closing this process's progress bars (see the module docstring)."""
    close_progress_bars()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or detached: nothing of ours is waiting in it
            pass
    os.write(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
