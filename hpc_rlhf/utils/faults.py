"""Deterministic fault injection, switched on by an environment variable, for testing failure handling.

    HPC_RLHF_FAULT="rank=3,phase=scoring,step=2,kind=kill"

makes rank 3 kill itself (SIGKILL) when it enters the `scoring` phase of optimizer step 2. Several faults are
separated by ';'. Keys of one fault:

    kind   kill    SIGKILL this process (as the out-of-memory killer or a node failure would)
           raise   raise InjectedFault (a RuntimeError) from the phase
           freeze  SIGSTOP this process: it stays alive but does nothing, like a hung GPU or a stuck file system
           hang    ignore the stop signals (SIGUSR1, SIGTERM) and sleep for good, its other threads still running:
                   a rank stuck in an uninterruptible write, which neither a stop signal nor Slurm's SIGCONT ends;
                   only SIGKILL does
           nan     make the training loss NaN on this rank (`poison`), as an overflow or bad batch would
           stop    send this process SIGUSR1, as Slurm's --signal does before the time limit: the job checkpoints
                   after the step in progress and exits for its requeue
    rank   global rank it applies to (default: every rank)
    phase  phase name, as given to `hpc_rlhf.dist.watchdog.phase` (default: any phase; `nan` faults: training)
    step   `2` (that step), `2-4` (inclusive range), `2+` (2 and later) or `*` (default: every step)

Step numbers are those of metrics.jsonl and checkpoint names: the optimizer step in progress, counted from 1
(0 before training, e.g. the first evaluation). The recipes call `point(phase, step)` at every phase boundary
(through `watchdog.phase`) and pass their loss through `poison(loss, step)` before the backward pass; with the
variable unset both cost one dictionary lookup.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import time
from dataclasses import dataclass

from hpc_rlhf.utils import console

FAULT_ENV = "HPC_RLHF_FAULT"
KINDS = ("kill", "raise", "freeze", "hang", "nan", "stop")
KEYS = ("kind", "rank", "phase", "step")
NAN_PHASE = "training"


class InjectedFault(RuntimeError):
    """The failure a `kind=raise` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    phase: str | None = None
    first_step: int | None = None  # None: every step
    last_step: int | None = None   # None with first_step set: that step and every later one

    def matches(self, rank: int, phase: str, step: int) -> bool:
        if self.rank is not None and rank != self.rank:
            return False
        if self.phase is not None and phase != self.phase:
            return False
        if self.first_step is not None and step < self.first_step:
            return False
        return self.last_step is None or step <= self.last_step

    def describe(self) -> str:
        parts = [f"kind={self.kind}"]
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        if self.phase is not None:
            parts.append(f"phase={self.phase}")
        if self.first_step is not None:
            if self.last_step == self.first_step:
                parts.append(f"step={self.first_step}")
            else:
                parts.append(f"step={self.first_step}{'+' if self.last_step is None else f'-{self.last_step}'}")
        return ",".join(parts)


def _bad(text: str, problem: str) -> ValueError:
    return ValueError(f"{FAULT_ENV}='{text}': {problem}")


def _whole_number(text: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise _bad(text, f"{key}={value!r} is not a whole number") from None
    if number < 0:
        raise _bad(text, f"{key}={value!r} must not be negative")
    return number


def _steps(text: str, value: str) -> tuple[int | None, int | None]:
    if value == "*":
        return None, None
    if re.fullmatch(r"\d+\+", value):
        return int(value[:-1]), None
    if re.fullmatch(r"\d+-\d+", value):
        low, high = (int(v) for v in value.split("-"))
        if high < low:
            raise _bad(text, f"step range {value!r} ends before it starts")
        return low, high
    if re.fullmatch(r"\d+", value):
        return int(value), int(value)
    raise _bad(text, f"step={value!r} is not N, N-M, N+ or * (N, M: step numbers from 0)")


def parse(text: str) -> list[Fault]:
    """The faults described by `text` (the variable's value); a ValueError names the part that is wrong."""
    faults = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        values: dict[str, str] = {}
        for item in (i.strip() for i in entry.split(",")):
            if "=" not in item:
                raise _bad(text, f"'{item}' is not of the form key=value (keys: {', '.join(KEYS)})")
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in KEYS:
                near = difflib.get_close_matches(key, KEYS, n=1)
                hint = f"; did you mean '{near[0]}'?" if near else f" (keys: {', '.join(KEYS)})"
                raise _bad(text, f"unknown key '{key}'{hint}")
            if key in values:
                raise _bad(text, f"'{key}' is given twice in '{entry}'")
            values[key] = value
        kind = values.get("kind")
        if kind is None:
            raise _bad(text, f"'{entry}' has no kind (one of {', '.join(KINDS)})")
        if kind not in KINDS:
            raise _bad(text, f"kind '{kind}' is not one of {', '.join(KINDS)}")
        rank = _whole_number(text, "rank", values["rank"]) if values.get("rank", "*") != "*" else None
        phase = values.get("phase") or (NAN_PHASE if kind == "nan" else None)
        if kind == "nan" and phase != NAN_PHASE:
            raise _bad(text, f"a nan fault poisons the loss, so its phase is '{NAN_PHASE}', not '{phase}'")
        first, last = _steps(text, values.get("step", "*"))
        faults.append(Fault(kind, rank, phase, first, last))
    return faults


_cache: tuple[str | None, list[Fault]] = (None, [])


def active() -> list[Fault]:
    """The faults of the current environment (parsed once per distinct value)."""
    global _cache
    text = os.environ.get(FAULT_ENV)
    if text != _cache[0]:
        _cache = (text, parse(text) if text else [])
    return _cache[1]


def _this_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def matching(phase: str, step: int, rank: int | None = None) -> Fault | None:
    """The kill/raise/freeze/hang/stop fault that `point(phase, step)` would fire on this rank, if any."""
    faults = active()
    if not faults:
        return None
    rank = _this_rank() if rank is None else rank
    return next((f for f in faults if f.kind != "nan" and f.matches(rank, phase, step)), None)


def point(phase: str, step: int, rank: int | None = None) -> None:
    """Fire the kill/raise/freeze/hang/stop fault that matches (this rank, `phase`, `step`), if there is one."""
    fault = matching(phase, step, rank)
    if fault is None:
        return
    where = f"rank {_this_rank() if rank is None else rank}, phase {phase}, step {step}"
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault ({FAULT_ENV}: {fault.describe()}) at {where}")
    if fault.kind == "stop":  # the stop handlers (runtime/checkpointing.StopSignal) take it; the rank goes on
        console.say(f"hpc_rlhf: injected stop signal ({FAULT_ENV}: {fault.describe()}) at {where}", fd=1)
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    # Flushed first: a killed or stopped process writes nothing afterwards. The wall-clock time lets a test (or
    # a reader of the log) measure how long the job took to end after the failure.
    if fault.kind == "hang":
        for stop in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(stop, signal.SIG_IGN)
    console.say(f"hpc_rlhf: injected fault ({FAULT_ENV}: {fault.describe()}) at {where} [unix time "
                f"{time.time():.3f}]", fd=1)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)


def poison(loss, step: int, rank: int | None = None):
    """`loss` made NaN when a nan fault matches (this rank, training, `step`); else `loss` itself."""
    faults = active()
    if not faults:
        return loss
    rank = _this_rank() if rank is None else rank
    if any(f.kind == "nan" and f.matches(rank, NAN_PHASE, step) for f in faults):
        return loss * float("nan")  # keeps the graph, so every gradient becomes NaN too
    return loss
