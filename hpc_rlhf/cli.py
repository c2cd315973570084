"""`hpc-rlhf <mode> ...` (also `python -m hpc_rlhf <mode> ...`): the command line. The table of modes and
commands, and how a mode runs from its arguments, are hpc_rlhf/launch/modes.py's (a Slurm task runs them too).
"""

from __future__ import annotations

import sys

from hpc_rlhf.launch.modes import COMMANDS, DESCRIPTIONS, TRAINING_MODES, run, usage  # noqa: F401  (the table)


def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
