"""The processes a rank starts through a library (vLLM's engine core and workers) end when the rank ends, however
it ends: exit, exception, the watchdog's os._exit, or kill -9.

Why: vLLM 0.32 starts its engine core with multiprocessing (spawn) and the engine core starts the workers. A
worker watches its engine core (a pipe that closes when it dies), but the engine core does not watch its parent:
measured here, after `kill -9` of the process that created `vllm.LLM` (the tiny model), the engine core and its
worker ran on as orphans, holding 1.6 GB of memory until killed by hand, and when their resource tracker was
killed with them, 400 MB of /dev/shm segments stayed behind. Slurm's proctrack/linuxproc does not find
re-parented orphans either.

How: `Reaper` starts a small watcher process (this file, run by path with `python -I -S`: standard library only,
~20 ms) in a session of its own, so a launcher that kills the rank's process group does not take it along. The
rank reports each process to watch (`watch PID STARTTIME` on the watcher's stdin); while a library call is creating
processes, `Reaper.watch_new_children()` reports the rank's new children and their descendants every 0.2 s, so a
rank that dies during vLLM's 30-second start-up leaves nothing behind either. The watcher acts when its stdin
reaches end of file (the rank's end closes it; spawned processes never inherit it) or when it sees the rank's pid
gone (a fork of the rank would hold the pipe open): it kills (SIGKILL) every watched process still running and
their descendants, checking start times so that a recycled pid is never hit, and then removes the files and
folders it was given (`remove PATH`: an engine's socket folder and file store, which killed processes leave
behind). A rank that shut the processes down itself writes `done` first, and the watcher leaves without killing or
removing anything.

multiprocessing's resource tracker, which the rank starts before any spawned process, is not watched: it outlives
the processes it tracks and removes the shared-memory segments they leave behind once they are gone.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time


# ------------------------------------------------------------------------------------------ /proc helpers
def process_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks since boot, state letter) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()  # the command name may contain spaces and parentheses
    return int(fields[1]), int(fields[19]), fields[0]


def start_time(pid: int) -> int | None:
    stat = process_stat(pid)
    return None if stat is None else stat[1]


def running(pid: int, started: int) -> bool:
    """Whether `pid` is still the process that started at `started` and has not ended (a zombie has)."""
    stat = process_stat(pid)
    return stat is not None and stat[1] == started and stat[2] != "Z"


def children_of(parents: set[int]) -> dict[int, int]:
    """{pid: start time} of the live processes whose parent is in `parents`."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = process_stat(int(entry))
            if stat is not None and stat[0] in parents and stat[2] != "Z":
                found[int(entry)] = stat[1]
    return found


def descendants(roots: set[int]) -> dict[int, int]:
    """{pid: start time} of every live descendant of `roots`."""
    found: dict[int, int] = {}
    frontier = set(roots)
    while frontier:
        new = {pid: start for pid, start in children_of(frontier).items() if pid not in found}
        found.update(new)
        frontier = set(new)
    return found


def kill_if_same(pid: int, started: int) -> bool:
    """SIGKILL `pid` unless it is gone or is another process now (a different start time)."""
    if not running(pid, started):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# ------------------------------------------------------------------------------------------ the rank's side
class Reaper:
    """The rank's handle on its watcher process (see the module docstring)."""

    def __init__(self, remove_when_gone: str | os.PathLike | None = None):
        _start_resource_tracker()  # before any spawned process: it is ours and must outlive them
        self.watched: dict[int, int] = {}
        self.known = set(children_of({os.getpid()}))  # what was there before: never ours to kill
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
                                      str(start_time(os.getpid()))],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                                     close_fds=True)
        self.known.add(self.proc.pid)
        if remove_when_gone is not None:
            self.remove_when_gone(remove_when_gone)

    def watch(self, pid: int, started: int) -> None:
        with self._lock:
            if pid in self.watched or self.proc.stdin is None:
                return
            self.watched[pid] = started
            self.proc.stdin.write(f"watch {pid} {started}\n".encode())
            self.proc.stdin.flush()

    def remove_when_gone(self, path: str | os.PathLike) -> None:
        """Have the watcher remove `path` (a file, or a folder and all it holds) once it has killed what it
        watches: never if the rank says `done`."""
        with self._lock:
            if self.proc.stdin is None:
                return
            self.proc.stdin.write(f"remove {os.path.abspath(path)}\n".encode())
            self.proc.stdin.flush()

    def watch_children(self) -> list[int]:
        """Report the rank's children that appeared since this object was made, and their descendants (a worker
        outlives its engine core for a moment and is then out of reach by parentage); returns what is watched."""
        new = {pid: started for pid, started in children_of({os.getpid()}).items() if pid not in self.known}
        for pid, started in {**new, **descendants(set(new) | set(self.watched))}.items():
            self.watch(pid, started)
        return list(self.watched)

    def watch_new_children(self, interval_s: float = 0.2):
        """Context manager: report new children every `interval_s` while the body runs, and once at its end."""
        return _Polling(self, interval_s)

    def reap(self, wait_s: float = 5.0) -> int:
        """Kill what is watched (whole trees) here and now, and wait up to `wait_s` for it to be gone; returns how
        many processes were killed."""
        alive = {pid: started for pid, started in self.watched.items() if running(pid, started)}
        targets = {**alive, **descendants(set(alive))}
        killed = sum(kill_if_same(pid, started) for pid, started in targets.items())
        deadline = time.monotonic() + wait_s
        while any(running(pid, started) for pid, started in targets.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return killed

    def done(self) -> None:
        """The rank has shut the watched processes down: the watcher leaves without killing anything."""
        with self._lock:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.write(b"done\n")
                    self.proc.stdin.close()
                except OSError:
                    pass
                self.proc.stdin = None
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Polling:
    def __init__(self, reaper: Reaper, interval_s: float):
        self.reaper, self.interval_s = reaper, interval_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpc_rlhf-reaper-poll", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.reaper.watch_children()

    def __enter__(self):
        self.thread.start()
        return self.reaper

    def __exit__(self, *exc) -> bool:
        self.stop.set()
        self.thread.join()
        self.reaper.watch_children()
        return False


def _start_resource_tracker() -> None:
    try:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    except Exception:  # noqa: BLE001 - only a saving (no leftover shared memory); never a reason to fail
        pass


# ------------------------------------------------------------------------------------------ the watcher
def watcher_main(rank_pid: int, rank_started: int, poll_s: float = 0.5) -> int:
    """Read `watch`/`remove`/`done` lines until end of file, or until the rank is seen gone (a fork of the rank
    would keep the pipe open), then kill what is watched and remove what it was told to."""
    # The launcher's Ctrl-C and SIGTERM are for the rank: the watcher acts when the rank is gone.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    watched: dict[int, int] = {}
    to_remove: list[str] = []
    pending = b""
    stdin = sys.stdin.buffer.raw
    while True:
        readable, _, _ = select.select([stdin], [], [], poll_s)
        if not readable:
            stat = process_stat(rank_pid)
            if stat is None or stat[1] != rank_started or stat[2] == "Z":
                break
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            words = line.split()
            if words[:1] == [b"done"]:
                return 0
            if words[:1] == [b"watch"] and len(words) == 3:
                watched[int(words[1])] = int(words[2])
            elif line.startswith(b"remove "):
                to_remove.append(os.fsdecode(line[len(b"remove "):]))
    # The rank is gone without `done`. Kill the whole trees at once: a worker whose engine core died first would
    # otherwise be re-parented out of reach.
    alive = {pid: started for pid, started in watched.items() if running(pid, started)}
    targets = {**alive, **descendants(set(alive))}
    for pid, started in targets.items():
        kill_if_same(pid, started)
    if to_remove:
        deadline = time.monotonic() + 5.0  # a killed process may still be closing its files
        while any(running(pid, started) for pid, started in targets.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
    for path in to_remove:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(watcher_main(int(sys.argv[1]), int(sys.argv[2])))
