"""Environment calls of one turn, run at the same time (tools are slow), each bounded by a timeout.

`run_calls` runs every call on a thread of its own, at most `max_concurrency` at once, and returns when each has
finished or run past its timeout. A call past its timeout is given up: its thread is left to end by itself (a
daemon thread, so a hung environment never keeps the process alive) and no longer counts against the
concurrency, so the other calls go on. Python cannot stop a thread, so a hung call keeps its thread until then;
with env.on_error=fail the job ends anyway, with skip only that episode's call hangs on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass
class CallOutcome:
    """How one call ended: `value` when it returned, `error` when it raised, `timed_out` when it ran too long."""
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def run_calls(calls: Sequence[Callable[[], Any]], max_concurrency: int, timeout_s: float) -> list[CallOutcome]:
    """Run `calls` concurrently (at most `max_concurrency` at a time), each within `timeout_s` seconds; the
    outcomes in the order of the calls."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    outcomes = [CallOutcome() for _ in calls]
    finished = [False] * len(calls)
    lock = threading.Condition()
    started: dict[int, float] = {}  # running calls -> start time
    next_call = 0

    def work(i: int) -> None:
        begin = time.perf_counter()
        try:
            value, error = calls[i](), None
        except BaseException as exc:  # noqa: BLE001 - an environment may raise anything; the caller reports it
            value, error = None, exc
        with lock:
            if not finished[i]:  # not given up on meanwhile
                outcomes[i] = CallOutcome(value=value, error=error, seconds=time.perf_counter() - begin)
                finished[i] = True
                started.pop(i, None)
            lock.notify_all()

    with lock:
        while next_call < len(calls) or started:
            while next_call < len(calls) and len(started) < max_concurrency:
                started[next_call] = time.perf_counter()
                threading.Thread(target=work, args=(next_call,), daemon=True,
                                 name=f"hpc_rlhf-env-call-{next_call}").start()
                next_call += 1
            now = time.perf_counter()
            for i, begin in list(started.items()):
                if now - begin >= timeout_s:
                    outcomes[i] = CallOutcome(timed_out=True, seconds=now - begin)
                    finished[i] = True
                    del started[i]
            if started:
                lock.wait(timeout=max(0.0, min(started.values()) + timeout_s - now))
    return outcomes
