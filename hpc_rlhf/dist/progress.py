"""What this rank is doing: the step in progress and its phase (`phase("scoring")`, `set_step(3)`), written by the
recipes' main thread and read by the watchdog's thread (dist/watchdog.py), which publishes them in its heartbeats and
names them when a rank fails. Each phase is also where HPC_RLHF_FAULT's injected faults fire (utils/faults.py).

Per step the recipes only enter phases and set the step, which set two attributes: nothing here talks to anyone.
"""

from __future__ import annotations

from typing import Callable

from hpc_rlhf.utils import faults


class Progress:
    """What this rank is doing: written by the main thread (phase(), set_step()), read by the watchdog."""

    __slots__ = ("stack", "name", "step")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stack: list[str] = []
        self.name = "setup"
        self.step = 0


class _Phase:
    __slots__ = ("progress", "name")

    def __init__(self, progress: Progress, name: str):
        self.progress, self.name = progress, name

    def __enter__(self) -> "_Phase":
        progress = self.progress
        progress.stack.append(self.name)
        progress.name = self.name
        try:
            if faults.active() and _BEFORE_FAULT is not None and faults.matching(self.name, progress.step):
                # An injected death would otherwise be reported with the phase of the last regular heartbeat.
                _BEFORE_FAULT()
            faults.point(self.name, progress.step)
        except BaseException:
            progress.stack.pop()  # the name stays: the failure happened in this phase
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        progress = self.progress
        progress.stack.pop()
        # Leaving an inner phase returns to the outer one. At the top level, and when leaving by an exception,
        # the name stays, so that a failure report says where it happened.
        if exc_type is None and progress.stack:
            progress.name = progress.stack[-1]
        return False


_PROGRESS = Progress()
_BEFORE_FAULT: Callable[[], None] | None = None


def current() -> Progress:
    return _PROGRESS


def reset() -> None:
    _PROGRESS.reset()


def before_fault(callback: Callable[[], None] | None) -> None:
    """Call `callback` (the watchdog's publish) before an injected fault fires in a phase; None: nothing."""
    global _BEFORE_FAULT
    _BEFORE_FAULT = callback


def phase(name: str) -> _Phase:
    """`with watchdog.phase("scoring"): ...` - published in the heartbeat; fault injection point."""
    return _Phase(_PROGRESS, name)


WAITING_ON = " (waiting on "  # in a phase name: the rank waits on an endpoint (`waiting_on`)


def waiting_on(what: str) -> _Phase:
    """`with watchdog.waiting_on("reward endpoint http://..."): ...` - the phase while this rank waits on something
    outside the job (an environment server, a remote reward): the current phase with what it waits on. Its peers
    wait for it in a collective meanwhile; if theirs time out, the watchdog names this rank and the endpoint as
    the cause (dist/watchdog.py), not the collective."""
    return phase(f"{_PROGRESS.name}{WAITING_ON}{what})")


def set_step(step: int) -> None:
    """The optimizer step in progress, counted from 1 (as in metrics.jsonl)."""
    _PROGRESS.step = int(step)


def current_phase() -> str:
    return _PROGRESS.name


def current_step() -> int:
    return _PROGRESS.step
