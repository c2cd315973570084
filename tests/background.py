"""Expensive shared work that starts with the test session and runs while other tests run.

The session's SFT base, the reward model the PPO tests start from and the local Slurm cluster with its jobs take
minutes of wall time, most of it in child processes. So `tests/conftest.py` starts each of them, when a collected
test needs it, as soon as collection is done, in a thread of this module that waits on the child processes; the
fixtures that hand them out wait for the result. Tests that need them are ordered last (learning tests, then
cluster tests), and `make test` runs the tests that wait for a shared model in a pytest process of their own
beside the other tests (scripts/run_suite.py).

A job's exception is raised again by `result`, in the fixture that asked, so a failed base fails the tests that
need it with its own message, as it would have without the head start.

A gate holds a job back until a point of the session: the local cluster's jobs wait at CLUSTER_JOBS_GATE, which
opens when the SFT base is trained (tests/recipes.py), or when the first cluster test starts if the
session trains no SFT base; and at VLLM_TESTS_GATE, which their lane opens when its vLLM tests (run first in it:
tests/conftest.py) are done. The SFT base and the reward model after it are the longest chain of the session
(every learning test waits for the first, three for the second); the cluster's jobs, needed only by the last
tests, would have slowed that chain by their share of the two cores.

Gates reach across pytest processes when HPC_RLHF_TEST_GATES names a folder (scripts/run_suite.py sets it for
both lanes): opening a gate also writes a file of its name there, and a process waiting at the gate goes on when
the file appears. So the lane that runs the cluster tests lets the cluster's jobs go when the other lane's SFT
base is trained.

A claim shares out work that either process may do (tests/conftest.py EITHER_LANE): the first process to claim a
name gets it, by creating a file of that name in the folder's `claims/` (the file system says which came first);
a process alone (no folder) gets every claim.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

CLUSTER_JOBS_GATE = "cluster-jobs"
VLLM_TESTS_GATE = "vllm-tests-done"
GATES_FOLDER = os.environ.get("HPC_RLHF_TEST_GATES") or None

_JOBS: dict[str, Future] = {}
_GATES: dict[str, threading.Event] = {}
_CLAIMS: dict[str, bool] = {}
_LOCK = threading.Lock()


def start(name: str, work: Callable[[], Any]) -> None:
    """Run `work()` in a thread of its own, once per session under `name` (a second start is ignored)."""
    with _LOCK:
        if name in _JOBS:
            return
        future: Future = Future()
        _JOBS[name] = future

    def run() -> None:
        mark("start", f"background {name}")
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the fixture that waits for it
            future.set_exception(exc)
        mark("end", f"background {name}")

    threading.Thread(target=run, name=f"background-{name}", daemon=True).start()


def mark(event: str, what: str) -> None:
    """A line in the lane's timeline (HPC_RLHF_TEST_TIMELINE, set by scripts/run_suite.py; tests/conftest.py):
    the time, the event, what, and after a tab the CPU-seconds this pytest process and its reaped children have
    used so far. A test's difference is its own CPU (its ranks are children reaped within it) plus that of any
    background job whose process ended during it; the local Slurm's jobs are not children and are not counted."""
    path = os.environ.get("HPC_RLHF_TEST_TIMELINE")
    if path:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        with open(path, "a") as f:
            f.write(f"{time.time():.1f} {event} {what}\t{cpu:.1f}\n")


def started(name: str) -> bool:
    return name in _JOBS


def result(name: str, work: Callable[[], Any] | None = None) -> Any:
    """Wait for the job `name` and return its result; with `work`, start it first if nobody has."""
    if name not in _JOBS:
        if work is None:
            raise KeyError(f"no background job '{name}' was started")
        start(name, work)
    return _JOBS[name].result()


def _gate(name: str) -> threading.Event:
    with _LOCK:
        return _GATES.setdefault(name, threading.Event())


def gates_shared_with_other_processes() -> bool:
    return GATES_FOLDER is not None


def open_gate(name: str) -> None:
    """Let every job waiting at gate `name` go on, in this process and (HPC_RLHF_TEST_GATES) in the others
    (opening it twice is harmless)."""
    if GATES_FOLDER is not None:
        Path(GATES_FOLDER, name).touch()
    if not _gate(name).is_set():
        mark("open", f"gate {name}")
    _gate(name).set()


def wait_for_the_cluster_jobs_turn() -> None:
    """The local cluster's jobs go in when the SFT base is trained (CLUSTER_JOBS_GATE) and the vLLM tests of their
    own lane are done (VLLM_TESTS_GATE): a vLLM request hops through three processes, each waiting for a core, and
    beside the jobs' ranks the 2-rank vLLM module test took 324 s against 33 s alone (fresh clone, 2026-11-26)."""
    wait_at_gate(CLUSTER_JOBS_GATE)
    wait_at_gate(VLLM_TESTS_GATE)


def wait_at_gate(name: str) -> None:
    """Block until gate `name` is open: a job that should not start before some point of the session."""
    gate = _gate(name)
    while not gate.wait(timeout=None if GATES_FOLDER is None else 1.0):
        if Path(GATES_FOLDER, name).exists():
            gate.set()


def claim(name: str) -> bool:
    """Whether this process does `name`: the first process of the suite to ask gets it, and keeps it (asking again
    gives the same answer); without HPC_RLHF_TEST_GATES every claim is this process's."""
    if GATES_FOLDER is None:
        return True
    with _LOCK:
        if name not in _CLAIMS:
            folder = Path(GATES_FOLDER, "claims")
            folder.mkdir(exist_ok=True)
            try:
                fd = os.open(folder / name.replace("/", "__"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                _CLAIMS[name] = False
            else:
                os.write(fd, f"{os.getpid()}\n".encode())
                os.close(fd)
                _CLAIMS[name] = True
                mark("claim", name)
        return _CLAIMS[name]
