"""How a rank failure is recognised and reported (the watchdog's pure helpers): which peers a rank watches and how
often it beats, whether a process on this host is alive, whether an exception is the consequence of a failure
elsewhere, and the one line a failing rank leaves before it ends.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hpc_rlhf.dist import liveness
from hpc_rlhf.utils import console

RING_WATCHED = 8

# Errors a collective or the store raises because a peer went away: effects of a failure elsewhere.
CONSEQUENCE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                       "timed out waiting", "pair closure", "connection refused", "socket timeout",
                       "communicator was aborted", "nccl error", "remote process exited")


def default_interval(timeout_s: float) -> float:
    """Beat often enough to notice a stale peer several beats before the timeout, but at most once a second."""
    return min(1.0, max(0.05, timeout_s / 8))


def watched_ranks(rank: int, world_size: int, store_host_rank: int | None) -> list[int]:
    """The next RING_WATCHED ranks on the ring, plus the rank hosting the store (its death takes the store)."""
    count = min(world_size - 1, RING_WATCHED)
    ranks = [(rank + i) % world_size for i in range(1, count + 1)]
    if store_host_rank is not None and store_host_rank != rank and store_host_rank not in ranks:
        ranks.append(store_host_rank)
    return ranks


def describe_exception(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def is_consequence(exc: BaseException) -> bool:
    """True for communication errors that a peer's failure causes (the exception or what it wraps)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "DistNetworkError":
            return True
        message = str(exc).lower()
        if any(marker in message for marker in CONSEQUENCE_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def process_alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _alive_a_moment_later(pid: int, wait_s: float) -> bool:
    """A dying process closes its sockets before it is gone: give it `wait_s` to finish dying."""
    deadline = time.monotonic() + wait_s
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.02)
    return False


def _pid_namespace() -> str:
    # Ranks in separate containers can share a host name but not their pids.
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def exit_with_message(message: str, end_pid: int | None = None) -> None:
    """Print the line, record it for the local launcher, end the process at once.

    end_pid: a frozen peer on this host, killed only now, after the record: the local launcher names the rank
    whose failure it learnt of first, and that is this rank's line, not the death of the peer it killed."""
    try:
        console.say(message)
        liveness.record_failure(message.removeprefix("hpc_rlhf: "))
        if end_pid is not None:
            try:
                os.kill(end_pid, signal.SIGKILL)
            except OSError:
                pass  # gone already, or killed by another rank that found it too
    finally:
        os._exit(1)
