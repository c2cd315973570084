"""Environment calls of one turn, run at the same time (tools are slow), each bounded by a timeout.

`run_calls` hands the calls to a pool of worker threads kept for the process, at most `max_concurrency` running at
once, and returns when each has finished or run past its timeout. The workers live on between turns: a thread per
call cost about as much as a call of a fast environment (starting a thread waits for the scheduler, which on a
busy machine takes milliseconds), and a worker runs call after call without waking the caller in between. A call
past its timeout is given up: it keeps its worker busy until it ends by itself (Python cannot stop a thread; the
workers are daemon threads, so a hung environment never keeps the process alive) and another worker takes its
place, so the other calls go on. With env.on_error=fail the job ends anyway, with skip only that call hangs on.
"""

from __future__ import annotations

import queue
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


class _Pool:
    """Worker threads that take (job, index) from a queue; `spare` of them wait idle at any time at most."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0      # workers waiting on the queue
        self.count = 0     # workers alive (stuck ones included)

    def ensure_idle(self, wanted: int) -> None:
        """Start workers until `wanted` of them are free for new calls."""
        with self.lock:
            missing = wanted - self.idle
            self.idle += max(missing, 0)
        for _ in range(missing):
            with self.lock:
                self.count += 1
                name = f"hpc_rlhf-env-worker-{self.count}"
            threading.Thread(target=self._work, daemon=True, name=name).start()

    def _work(self) -> None:
        while True:
            job, index = self.queue.get()
            with self.lock:
                self.idle -= 1
            job.run(index)
            with self.lock:
                self.idle += 1


_POOL = _Pool()


class _Job:
    """One `run_calls`: its calls, their outcomes, and the caller waiting for them."""

    def __init__(self, calls: Sequence[Callable[[], Any]]):
        self.calls = calls
        self.outcomes = [CallOutcome() for _ in calls]
        self.finished = [False] * len(calls)
        self.started: dict[int, float] = {}  # running calls -> start time
        self.done = threading.Condition()

    def run(self, i: int) -> None:
        with self.done:
            self.started[i] = time.perf_counter()
            self.done.notify_all()  # the caller times this call from now
        begin = time.perf_counter()
        try:
            value, error = self.calls[i](), None
        except BaseException as exc:  # noqa: BLE001 - an environment may raise anything; the caller reports it
            value, error = None, exc
        with self.done:
            if not self.finished[i]:  # not given up on meanwhile
                self.outcomes[i] = CallOutcome(value=value, error=error, seconds=time.perf_counter() - begin)
                self.finished[i] = True
                self.started.pop(i, None)
            self.done.notify_all()


def run_calls(calls: Sequence[Callable[[], Any]], max_concurrency: int, timeout_s: float) -> list[CallOutcome]:
    """Run `calls` concurrently (at most `max_concurrency` at a time), each within `timeout_s` seconds; the
    outcomes in the order of the calls."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    job = _Job(calls)
    queued = 0
    with job.done:
        while not all(job.finished):
            # keep at most max_concurrency of this job's calls queued or running, and a worker free for each
            in_flight = queued - sum(job.finished)
            fresh = min(max_concurrency - in_flight, len(calls) - queued)
            if fresh > 0:
                _POOL.ensure_idle(fresh)
                for i in range(queued, queued + fresh):
                    _POOL.queue.put((job, i))
                queued += fresh
            now = time.perf_counter()
            for i, begin in list(job.started.items()):
                if now - begin >= timeout_s:  # given up: its worker stays with it, another takes its place
                    job.outcomes[i] = CallOutcome(timed_out=True, seconds=now - begin)
                    job.finished[i] = True
                    del job.started[i]
            if not all(job.finished):
                deadline = min(job.started.values(), default=now) + timeout_s
                job.done.wait(timeout=max(0.001, deadline - now) if job.started else timeout_s)
    return job.outcomes
