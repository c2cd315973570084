"""`hpc-rlhf <mode> ...` (also `python -m hpc_rlhf <mode> ...`): the command line. The table of modes and
commands, and how a mode runs from its arguments, are hpc_rlhf/launch/modes.py's (a Slurm task runs them too).
"""

from __future__ import annotations

from typing import NoReturn

from hpc_rlhf.launch.modes import COMMANDS, DESCRIPTIONS, TRAINING_MODES, run, usage  # noqa: F401  (the table)
from hpc_rlhf.utils.process_end import end_process


def main(argv: list[str] | None = None) -> int:
    return run(argv)


def console_main() -> NoReturn:
    """The process of `hpc-rlhf` and `python -m hpc_rlhf`: main(), then an end without the interpreter's teardown
    (hpc_rlhf.utils.process_end: seconds of CPU in every rank of a job)."""
    end_process(main)


if __name__ == "__main__":
    console_main()
